"""The launcher: one worker per pool entry, pinned to its cards, concurrency 1, restarted when it exits."""

from __future__ import annotations

import sys

import pytest

from genserver import config
from genserver.scheduling.pools import default_layout, load_layout
from tests.support.waits import wait_for
from workers.launcher import cpu_threads_per_worker, worker_argv, worker_env
from workers.supervise import Supervisor


def test_each_gpu_worker_is_pinned_to_its_card_with_concurrency_one():
    layout = default_layout(num_gpus=4)
    cards = [w for w in layout.workers if w.denoises]
    assert [w.devices for w in cards] == [(0,), (1,), (2,), (3,)]
    for spec in cards:
        argv, env = worker_argv(spec), worker_env(spec)
        assert env["CUDA_VISIBLE_DEVICES"] == str(spec.devices[0])
        assert argv[argv.index("--concurrency") + 1] == "1"
        assert argv[argv.index("--queues") + 1] == ",".join(spec.queues)
        assert argv[argv.index("--hostname") + 1] == f"{spec.name}@{config.node()}"
    # Every card takes every class, images first (their priority band); GENSERVER_IMAGE_CARDS keeps some off video.
    assert all(w.queues == ("short", "medium", "long") for w in cards)
    assert {w.name for w in layout.workers} >= {"encode", "decode"}


def test_cpu_layout_uses_the_same_logic_without_devices():
    layout = default_layout(num_gpus=0, cpu_workers=2)
    assert [w.name for w in layout.workers] == ["cpu0", "cpu1", "encode", "decode"]
    assert all(worker_env(w)["CUDA_VISIBLE_DEVICES"] == "" for w in layout.workers)


def test_workers_share_the_cores_out_for_torch(monkeypatch):
    layout = default_layout(num_gpus=0, cpu_workers=2)  # 4 processes
    monkeypatch.delenv("GENSERVER_TORCH_THREADS", raising=False)
    monkeypatch.setattr("workers.launcher.os.cpu_count", lambda: 16)
    assert cpu_threads_per_worker(layout) == 4
    monkeypatch.setattr("workers.launcher.os.cpu_count", lambda: 2)
    assert cpu_threads_per_worker(layout) == 1  # never 0
    monkeypatch.setenv("GENSERVER_TORCH_THREADS", "3")
    assert cpu_threads_per_worker(layout) == 3
    env = worker_env(layout.workers[0], 3)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in worker_env(layout.workers[0])


def test_layout_override_from_json_and_file(tmp_path):
    inline = (
        '{"workers": [{"name": "big", "queues": ["short", "medium", "long"], "devices": [0, 1]},'
        '{"name": "side", "queues": ["encode", "decode"]}]}'
    )
    layout = load_layout(inline, num_gpus=8)
    assert worker_env(layout.workers[0])["CUDA_VISIBLE_DEVICES"] == "0,1"
    path = tmp_path / "pools.toml"
    path.write_text('[[workers]]\nname = "a"\nqueues = ["short", "medium", "long", "encode", "decode"]\n')
    assert [w.name for w in load_layout(str(path), num_gpus=0).workers] == ["a"]
    with pytest.raises(ValueError, match="without a worker"):
        load_layout('{"workers": [{"name": "a", "queues": ["short"]}]}', num_gpus=0)
    with pytest.raises(ValueError, match="unknown queues"):
        load_layout('{"workers": [{"name": "a", "queues": ["shrt"]}]}', num_gpus=0)


def test_supervisor_restarts_a_child_that_exits_and_stops_all():
    supervisor = Supervisor(stop_timeout=5)
    child = supervisor.add("sleeper", [sys.executable, "-c", "import time; time.sleep(0.2)"])
    first_pid = child.process.pid
    wait_for(lambda: (supervisor.poll(), child.process.pid != first_pid)[1], 10, what="the child to be restarted")
    assert child.restarts == 1
    supervisor.stop()
    assert child.process.poll() is not None


def test_a_worker_dedicated_to_a_model_reads_only_that_models_queues():
    layout = load_layout(
        '{"workers": ['
        '{"name": "sdxl", "queues": ["short", "medium"], "devices": [0], "models": ["sdxl-sim"]},'
        '{"name": "any", "queues": ["short", "medium", "long"], "devices": [1]},'
        '{"name": "side", "queues": ["encode", "decode", "control"]}]}',
        num_gpus=2,
    )
    dedicated, shared = layout.workers[0], layout.workers[1]
    assert dedicated.consumed_queues() == ("short.sdxl-sim", "medium.sdxl-sim")
    assert worker_argv(dedicated)[worker_argv(dedicated).index("--queues") + 1] == "short.sdxl-sim,medium.sdxl-sim"
    assert worker_env(dedicated)["GENSERVER_WORKER_QUEUES"] == "short.sdxl-sim,medium.sdxl-sim"
    assert shared.consumed_queues() == ("short", "medium", "long")
    # Jobs of the dedicated model go to its own queues; others to the class queues.
    assert layout.queue_for("short", "sdxl-sim") == "short.sdxl-sim"
    assert layout.queue_for("short", "flux-sim") == "short"
    assert layout.capacity("short.sdxl-sim") == 1 and layout.capacity("short") == 1


def test_admission_counts_only_the_dedicated_cards_for_their_model():
    from genserver.scheduling.admission import AdmissionLimits, WorkItem, decide

    layout = load_layout(
        '{"workers": ['
        '{"name": "a", "queues": ["short", "medium", "long"], "models": ["wan-sim"]},'
        '{"name": "b", "queues": ["short", "medium", "long"]},'
        '{"name": "c", "queues": ["encode", "decode"]}]}',
        num_gpus=0,
    )
    busy = [WorkItem(queue="long.wan-sim", priority=7, remaining_seconds=2000.0)]
    refused = decide("long.wan-sim", 7, busy, layout, AdmissionLimits())
    assert not refused.accepted and "long class" in refused.reason
    assert decide("long", 7, busy, layout, AdmissionLimits()).accepted  # card b is free for other models


def test_long_work_cap_and_image_cards_shape_the_generated_layout():
    capped = default_layout(num_gpus=8, max_long_cards=2)
    assert [w.name for w in capped.workers if "long" in w.queues] == ["gpu6", "gpu7"]
    assert capped.capacity("long") == 2 and capped.capacity("short") == 8
    lent = default_layout(num_gpus=4, image_cards=0)
    assert lent.capacity("long") == 4
    with pytest.raises(ValueError, match="at least 1"):
        default_layout(num_gpus=4, max_long_cards=0)
    with pytest.raises(ValueError, match="image_cards"):
        default_layout(num_gpus=4, image_cards=4)


def test_a_card_group_is_one_worker_that_sees_all_its_cards():
    layout = default_layout(num_gpus=8, group_cards=4)
    group = layout.workers[0]
    argv, env = worker_argv(group), worker_env(group)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # one process, all k cards: the runtime splits a job over them
    assert env["GENSERVER_GROUP_SIZE"] == "4"
    assert argv[argv.index("--concurrency") + 1] == "1"  # one job at a time on the whole group
    assert argv[argv.index("--queues") + 1] == "short@interactive,medium@interactive,long@interactive"
    assert env["GENSERVER_WORKER_QUEUES"] == argv[argv.index("--queues") + 1]
    singles = [w for w in layout.workers if w.denoises and not w.lane]
    assert [worker_env(w)["CUDA_VISIBLE_DEVICES"] for w in singles] == ["4", "5", "6", "7"]
    assert all("GENSERVER_GROUP_SIZE" not in worker_env(w) for w in singles)
    # Declared by hand: a lane on any pool entry.
    custom = load_layout(
        '{"workers": ['
        '{"name": "g", "queues": ["long"], "devices": [0, 1], "lane": "interactive"},'
        '{"name": "s", "queues": ["short", "medium", "long", "encode", "decode"], "devices": [2]}]}',
        num_gpus=3,
    )
    assert worker_argv(custom.workers[0])[worker_argv(custom.workers[0]).index("--queues") + 1] == "long@interactive"
    assert worker_env(custom.workers[0])["CUDA_VISIBLE_DEVICES"] == "0,1"
