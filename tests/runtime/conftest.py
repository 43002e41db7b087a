"""Fixtures for the runtime tests: one tiny checkpoint and one loaded model per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from genserver.registry import ModelSpec, load_registry
from workers.runtime.tiny_models import ensure_tiny_models
from workers.runtime.unet import UNetFamily


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GENSERVER_DATA_DIR-like directory holding models/tiny-sd (generated, never downloaded)."""
    root = tmp_path_factory.mktemp("data")
    ensure_tiny_models(root / "models")
    return root


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return load_registry().get("tiny-sd")


@pytest.fixture(scope="session")
def family(tiny_spec: ModelSpec, data_dir: Path) -> UNetFamily:
    return UNetFamily(tiny_spec, "cpu", data_dir)
