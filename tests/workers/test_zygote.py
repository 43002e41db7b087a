"""The workers' fork server (workers/zygote.py): a forked child is the process `python -m` would start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.waits import wait_for
from workers.supervise import Supervisor
from workers.zygote import UNKNOWN_EXIT, Zygote

PROBE = [sys.executable, "-m", "tests.support.zygote_probe"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def probe_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, **extra)


def test_a_forked_child_has_its_own_environment_argv_session_and_random_state(zygote, tmp_path):
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    children = [
        zygote.spawn([*PROBE, str(out)], probe_env(ZYGOTE_PROBE=f"value {i}", OMP_NUM_THREADS="1"), cwd=str(ROOT))
        for i, out in enumerate(outs)
    ]
    assert all(children), "the zygote refused to fork (its preload touched CUDA, Django's settings or genserver)"
    assert [child.wait(60) for child in children] == [0, 0]
    a, b = (json.loads(out.read_text()) for out in outs)
    assert (a["probe_value"], b["probe_value"]) == ("value 0", "value 1")
    assert a["argv"][1:] == [str(outs[0])] and a["cwd"] == a["path0"] == str(ROOT)
    assert a["pid"] == a["pgid"] == children[0].pid  # a session of its own: killpg reaches it and its pool
    assert a["torch_preloaded"] and a["torch_threads"] == 1  # imported once, threads set from its environment
    assert a["random"] != b["random"]  # reseeded, not the zygote's sequence twice


def test_exit_statuses_read_as_popen_reads_them(zygote, tmp_path):
    exiting = zygote.spawn([*PROBE, str(tmp_path / "x.json"), "3"], probe_env(), cwd=str(ROOT))
    assert exiting.wait(60) == 3 and exiting.poll() == 3
    waiting = zygote.spawn([*PROBE, str(tmp_path / "w.json"), "wait"], probe_env(), cwd=str(ROOT))
    wait_for((tmp_path / "w.json").exists, 60, what="the child to start")
    assert waiting.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(0.2)
    os.killpg(waiting.pid, signal.SIGKILL)
    assert waiting.wait(60) == -signal.SIGKILL


def test_only_python_dash_m_children_with_our_python_variables_are_forked(zygote):
    assert zygote.spawn([sys.executable, "-c", "pass"], probe_env()) is None
    assert zygote.spawn(["/bin/true"], probe_env()) is None
    # sys.path and the hash seed were fixed when the zygote started: a child that sets them needs its own start.
    assert zygote.spawn([*PROBE, "/dev/null"], probe_env(PYTHONPATH="/elsewhere")) is None


def test_the_supervisor_restarts_a_forked_child_from_the_zygote(zygote, tmp_path):
    out = tmp_path / "restarted.json"
    supervisor = Supervisor(stop_timeout=5, zygote=zygote)
    child = supervisor.add("probe", [*PROBE, str(out), "wait"], forked=True)
    try:
        wait_for(out.exists, 60, what="the forked child")
        first = json.loads(out.read_text())["pid"]
        assert first == child.process.pid and type(child.process).__name__ == "ForkedProcess"
        out.unlink()
        os.killpg(first, signal.SIGKILL)
        wait_for(lambda: (supervisor.poll(), out.exists())[1], 60, interval=0.1, what="the restart")
        assert child.last_exit == -signal.SIGKILL and child.restarts == 1
        assert json.loads(out.read_text())["pid"] == child.process.pid != first
    finally:
        supervisor.stop()
    assert child.process.poll() is not None


def test_a_child_outlives_its_zygote_and_its_end_is_still_seen(tmp_path):
    zygote = Zygote(modules=["json"])  # what it imported does not matter here
    out = tmp_path / "orphan.json"
    child = zygote.spawn([*PROBE, str(out), "wait"], probe_env(), cwd=str(ROOT))
    wait_for(out.exists, 60, what="the child to start")
    zygote.process.kill()
    zygote.process.wait()
    assert child.poll() is None  # still running, now init's child
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(30) == UNKNOWN_EXIT  # init reaped it: its status is gone, its end is not
    assert zygote.spawn([*PROBE, "/dev/null"], probe_env()) is None  # later children start with Popen
