"""The worker launcher: one Celery worker per pool entry, pinned to its cards, restarted if it exits.

    python -m workers.launcher            # the layout from GENSERVER_POOLS, or generated
    python -m workers.launcher --print    # show the layout and the commands, start nothing

Each worker runs with concurrency 1 (a denoise step is compute-bound: one job
per card), no prefetch, CUDA_VISIBLE_DEVICES set to its cards (empty on CPU),
and loads its models lazily in the process that runs the tasks. A card group
(an entry with k > 1 devices) is one worker that sees all k cards
(GENSERVER_GROUP_SIZE=k) and runs one job at a time over them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os

from genserver.scheduling.pools import PoolLayout, WorkerSpec

from .supervise import Supervisor, python


def worker_argv(spec: WorkerSpec, loglevel: str = "INFO") -> list[str]:
    return [python(), "-m", "celery", "-A", "genserver", "worker",
            "--hostname", f"{spec.name}@%h", "--queues", ",".join(spec.consumed_queues()),
            "--concurrency", "1", "--pool", os.environ.get("GENSERVER_WORKER_POOL", "solo"),
            "--prefetch-multiplier", "1",
            "--without-gossip", "--without-mingle", "--task-events", "--loglevel", loglevel]


def cpu_threads_per_worker(layout: PoolLayout) -> int:
    """CPU threads for each worker's torch (GENSERVER_TORCH_THREADS, else the cores shared out).

    Workers on one host share its cores; torch's default (every core in every
    worker) makes OpenMP threads spin against each other, which on a busy
    2-core machine made steps 10-300× slower. On a GPU worker the CPU side
    only feeds the card, and one or two threads are enough.
    """
    configured = os.environ.get("GENSERVER_TORCH_THREADS", "")
    if configured:
        return max(1, int(configured))
    return max(1, (os.cpu_count() or 1) // max(1, len(layout.workers)))


def worker_env(spec: WorkerSpec, torch_threads: int | None = None) -> dict[str, str]:
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in spec.devices),
           "GENSERVER_WORKER_NAME": spec.name, "GENSERVER_WORKER_QUEUES": ",".join(spec.consumed_queues())}
    if spec.models:
        env["GENSERVER_WORKER_MODELS"] = ",".join(spec.models)
    if torch_threads:  # read by torch's OpenMP/MKL runtimes when the worker imports torch
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
    if spec.group_size > 1:
        # A card group: one process sees all k cards and runs one job at a time over them
        # (workers/runtime/group.py: diffusers' context parallelism where the family has it).
        env["GENSERVER_GROUP_SIZE"] = str(spec.group_size)
    return env


def start_workers(supervisor: Supervisor, layout: PoolLayout, loglevel: str = "INFO") -> None:
    threads = cpu_threads_per_worker(layout)
    for spec in layout.workers:
        supervisor.add(f"worker {spec.name}", worker_argv(spec, loglevel), worker_env(spec, threads))


def current_layout() -> PoolLayout:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
    import django

    django.setup()
    from genserver import deployment

    return deployment.layout()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the layout and commands, start nothing")
    parser.add_argument("--loglevel", default=os.environ.get("GENSERVER_WORKER_LOGLEVEL", "INFO"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(message)s")
    layout = current_layout()
    if args.print:
        print(json.dumps(layout.to_dict(), indent=2))
        for spec in layout.workers:
            env = " ".join(f"{k}={v}" for k, v in worker_env(spec, cpu_threads_per_worker(layout)).items())
            print(env, " ".join(worker_argv(spec, args.loglevel)))
        return
    supervisor = Supervisor()
    start_workers(supervisor, layout, args.loglevel)
    supervisor.run_forever()


if __name__ == "__main__":
    main()
