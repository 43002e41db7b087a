"""Layers import downward only: the import contracts in .importlinter hold, and the API never loads torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    """`lint-imports` reads .importlinter at the repository root (function-level imports included)."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"lint-imports found a broken contract:\n{done.stdout}\n{done.stderr}"
    assert "0 broken" in done.stdout, done.stdout


def run_with_django(program: str) -> str:
    """`program`'s standard output, run in a fresh interpreter with the service's settings (it must succeed)."""
    env = os.environ | {"DJANGO_SETTINGS_MODULE": "genserver.settings"}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_api_does_not_import_torch():
    """A fresh process that loads the API's URLconf (every view, serializer and the job service) has no torch."""
    program = (
        "import sys, django; django.setup(); import genserver.urls; "
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] in ('torch', 'tasks', 'workers')); "
        "print(' '.join(loaded) or 'clean')"
    )
    stdout = run_with_django(program)
    assert stdout.strip() == "clean", f"importing genserver.urls loaded: {stdout.strip()}"


def test_beat_does_not_import_torch_and_a_worker_registers_the_tasks():
    """Beat starts as celery/apps/beat.py does (the loader's worker init: `imports` and autodiscovered
    modules) and loads no torch; a worker's start (the `celeryd_init` signal) then registers tasks/."""
    program = (
        "import sys, django; django.setup(); from celery import signals; from genserver.celery import app; "
        "app.loader.init_worker(); "
        "beat = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'tasks'); "
        "signals.celeryd_init.send(sender='card0@test', instance=None, conf=app.conf, options={}); "
        "names = sorted(n for n in app.tasks if n.startswith('tasks.')); "
        "print(' '.join(beat) or 'clean'); print(len(names), 'torch' in sys.modules)"
    )
    beat, worker = run_with_django(program).strip().splitlines()
    assert beat == "clean", f"beat's start loaded: {beat}"
    registered, torch_loaded = worker.split()
    assert int(registered) >= 5 and torch_loaded == "True", worker
