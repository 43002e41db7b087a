"""A registry model whose weights are missing is a clear error at start-up, not at its first job."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from genserver import deployment
from genserver.jobs.checks import registry_checkpoints_exist


@pytest.fixture
def registry_with_missing_weights(tmp_path, settings):
    path = tmp_path / "registry.toml"
    path.write_text(
        '[models.real-sdxl]\nfamily = "unet"\nbackend = "diffusers"\n'
        f'path = "{tmp_path}/nowhere"\ncost_points = {{ 4096 = 2.9 }}\n'
    )
    settings.REGISTRY_PATH = str(path)
    deployment.registry.cache_clear()
    yield tmp_path
    deployment.registry.cache_clear()


def test_missing_checkpoint_fails_the_system_check(registry_with_missing_weights):
    (error,) = registry_checkpoints_exist()
    assert error.id == "genserver.E002"
    assert "real-sdxl" in error.msg and f"{registry_with_missing_weights}/nowhere" in error.msg
    assert "make_tiny_models" in error.msg
    with pytest.raises(SystemCheckError, match="real-sdxl"):
        call_command("check")


def test_shipped_registry_passes_once_tiny_models_exist(db):
    # The session fixture put the tiny checkpoints into the data directory (tests/support/tiny_models.py).
    assert registry_checkpoints_exist() == []
