"""The tiny random-weight checkpoints, generated once per test run and copied to wherever a test wants them.

Generating them (`ensure_tiny_models`, the code `manage.py make_tiny_models` runs) is ~7 CPU-s; the suite
wanted them in every xdist worker's data directory, in the runtime tests' directory and in each GPU-bench
case, some eight times a run. The first process to need them generates them into the run's cache directory
(created by the controller in `pytest_configure`, inherited by the xdist workers through the environment) under a
file lock, and every caller gets a copy: the same bytes, since generation is seeded. The tests of generation itself
(tests/runtime/test_family_contract.py, `make up` in tests/test_stack_up.py) still generate.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import uuid
from pathlib import Path

CACHE_VARIABLE = "PYTEST_TINY_MODELS_CACHE"


def open_run_cache() -> Path | None:
    """In the run's first process (the controller): create the cache directory and name it in the environment
    for the processes it starts; None where a parent already did (an xdist worker)."""
    if os.environ.get(CACHE_VARIABLE):
        return None
    path = Path(tempfile.mkdtemp(prefix="genserver-tiny-models-"))
    os.environ[CACHE_VARIABLE] = str(path)
    return path


def _cache() -> Path:
    path = os.environ.get(CACHE_VARIABLE)
    if not path:
        raise RuntimeError(f"{CACHE_VARIABLE} is not set: tests/conftest.py's pytest_configure sets it")
    return Path(path)


def copy_tiny_models(models_dir: Path) -> Path:
    """Every tiny checkpoint under `models_dir` (those already there kept); returns `models_dir`."""
    from workers.runtime.tiny_models import TINY_MODELS, ensure_tiny_models  # torch and diffusers: not at collection

    cache = _cache()
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one generator; the others wait and copy its result
        ensure_tiny_models(cache / "models")
    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    for name in TINY_MODELS:
        final = models_dir / name
        if final.exists():
            continue
        tmp = models_dir / f".{name}.copy-{uuid.uuid4().hex[:8]}"
        shutil.copytree(cache / "models" / name, tmp)
        os.rename(tmp, final)  # whole or absent, as ensure_tiny_models leaves it
    return models_dir
