"""The worker launcher: one Celery worker per pool entry, pinned to its cards, restarted if it exits.

    python -m workers.launcher            # the layout from GENSERVER_POOLS, or generated
    python -m workers.launcher --print    # show the layout and the commands, start nothing
    python -m workers.launcher --print --format systemd   # this node's units (or: procfile)

GENSERVER_NODE (default the host name) names this launcher's node: each worker
is `gpu0@NODE` to Celery, to the liveness keys and to the leases it holds.

Each worker runs with concurrency 1 (a denoise step is compute-bound: one job
per card), no prefetch, CUDA_VISIBLE_DEVICES set to its cards (empty on CPU),
and loads its models lazily in the process that runs the tasks. A card group
(an entry with k > 1 devices) is one worker that sees all k cards
(GENSERVER_GROUP_SIZE=k) and runs one job at a time over them.

On a CPU layout (GENSERVER_WORKER_FORKSERVER=auto) the workers, and their
restarts, fork from one zygote that imported torch and diffusers once
(workers/zygote.py): a start is Django's setup and Celery's, not 3 CPU-s of imports.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from genserver import config
from genserver.config import SettingsError, exit_on_settings_error
from genserver.scheduling.pools import PoolLayout, WorkerSpec

from . import zygote
from .supervise import Supervisor, python


def worker_hostname(spec: WorkerSpec | str, node: str | None = None) -> str:
    """The worker's name in the cluster, `gpu0@NODE`: its Celery hostname, liveness key, heartbeat and
    lease owner (GENSERVER_NODE, default the host name), so two nodes' `gpu0` never collide."""
    name = spec if isinstance(spec, str) else spec.name
    return f"{name}@{node or config.node()}"


def worker_argv(spec: WorkerSpec, loglevel: str = "INFO", node: str | None = None) -> list[str]:
    return [
        python(),
        "-m",
        "celery",
        "-A",
        "genserver",
        "worker",
        "--hostname",
        worker_hostname(spec, node),
        "--queues",
        ",".join(spec.consumed_queues()),
        "--concurrency",
        "1",
        "--pool",
        config.worker_pool(),
        "--prefetch-multiplier",
        "1",
        "--without-gossip",
        "--without-mingle",
        "--task-events",
        "--loglevel",
        loglevel,
    ]


def cpu_threads_per_worker(layout: PoolLayout) -> int:
    """CPU threads for each worker's torch (GENSERVER_TORCH_THREADS, else the cores shared out).

    Workers on one host share its cores; torch's default (every core in every
    worker) makes OpenMP threads spin against each other, which on a busy
    2-core machine made steps 10-300× slower. On a GPU worker the CPU side
    only feeds the card, and one or two threads are enough.
    """
    configured = config.torch_threads()
    if configured is not None:
        return configured
    return max(1, (os.cpu_count() or 1) // max(1, len(layout.workers)))


def worker_env(spec: WorkerSpec, torch_threads: int | None = None) -> dict[str, str]:
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in spec.devices),
        "GENSERVER_WORKER_NAME": spec.name,
        "GENSERVER_WORKER_QUEUES": ",".join(spec.consumed_queues()),
    }
    if spec.models:
        env["GENSERVER_WORKER_MODELS"] = ",".join(spec.models)
    if torch_threads:  # read by torch's OpenMP/MKL runtimes when the worker imports torch
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
    if spec.group_size > 1:
        # A card group: one process sees all k cards and runs one job at a time over them
        # (workers/runtime/group.py: diffusers' context parallelism where the family has it).
        env["GENSERVER_GROUP_SIZE"] = str(spec.group_size)
    return env


def forks_workers(layout: PoolLayout) -> bool:
    """Whether the layout's workers fork from the zygote (GENSERVER_WORKER_FORKSERVER; auto: CPU layouts)."""
    setting = config.worker_forkserver()
    return setting == "on" or (setting == "auto" and not any(spec.devices for spec in layout.workers))


def use_zygote(supervisor: Supervisor, layout: PoolLayout) -> bool:
    """Give `supervisor` this process's zygote when the layout's workers fork from it; say whether they do."""
    if not forks_workers(layout):
        return False
    if supervisor.zygote is None:
        supervisor.zygote = zygote.shared()
    return True


def start_workers(supervisor: Supervisor, layout: PoolLayout, loglevel: str | None = None) -> None:
    """One supervised Celery worker per entry (log level: `loglevel`, else GENSERVER_WORKER_LOGLEVEL)."""
    threads = cpu_threads_per_worker(layout)
    forked = use_zygote(supervisor, layout)
    for spec in layout.workers:
        argv = worker_argv(spec, loglevel or config.worker_loglevel())
        supervisor.add(f"worker {spec.name}", argv, worker_env(spec, threads), forked=forked)


def current_layout() -> PoolLayout:
    """The layout the settings describe; a bad setting raises SettingsError naming it (nothing started yet)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
    import django

    django.setup()  # reads the settings: a malformed GENSERVER_* value raises SettingsError here
    from genserver import deployment

    try:
        return deployment.layout()
    except ValueError as exc:  # GENSERVER_POOLS was parsed with the settings: what is left is the generated layout
        knobs = ("GENSERVER_IMAGE_CARDS", "GENSERVER_MAX_LONG_CARDS", "GENSERVER_GROUP_CARDS")
        named = " and ".join([k for k in knobs if os.environ.get(k, "").strip()] or knobs)
        raise SettingsError(
            named,
            str(exc),
            "values that leave every class a card among the GENSERVER_NUM_GPUS "
            "(or detected) cards, or GENSERVER_CPU_WORKERS on CPU (docs/CONFIGURATION.md)",
        ) from None


def refuse_unfit_layout(layout: PoolLayout) -> None:
    """Exit with the memory plan's message when the layout's cards cannot hold what its workers load.

    Only diffusers entries whose checkpoint directory exists count (the simulated backend holds
    nothing); a CPU layout has no card to fill. The card's size is GENSERVER_CARD_GIB, else the
    smallest card nvidia-smi reports; unknown, the check is skipped with a log line.
    """
    if not any(spec.devices for spec in layout.workers):
        return
    from django.conf import settings

    from genserver import deployment

    from .memory_plan import check_layout, detected_card_bytes

    card_bytes = detected_card_bytes()
    if card_bytes is None:
        logging.warning("memory plan skipped: card memory unknown (set GENSERVER_CARD_GIB)")
        return
    problems = check_layout(layout, deployment.registry(), card_bytes, settings.MODEL_CACHE_BYTES, settings.DATA_DIR)
    if problems:
        raise SystemExit(
            "launcher: this layout does not fit its cards; nothing started.\n"
            + "\n".join(problems)
            + "\n(`python -m workers.memory_plan --card-gib N` prints the whole plan)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the layout and commands, start nothing")
    parser.add_argument("--loglevel", help="Celery's log level for the workers (default GENSERVER_WORKER_LOGLEVEL)")
    parser.add_argument(
        "--format",
        choices=("text", "systemd", "procfile"),
        default="text",
        help="with --print: the layout and commands (text), systemd units, or Procfile lines",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(message)s")
    with exit_on_settings_error():  # before any worker starts
        layout = current_layout()
        args.loglevel = args.loglevel or config.worker_loglevel()
    if args.print and args.format != "text":
        from genserver.config import BASE_DIR

        from .units import procfile, systemd_units

        refuse_unfit_layout(layout)
        node = config.node()
        print(
            systemd_units(layout, node, args.loglevel, BASE_DIR)
            if args.format == "systemd"
            else procfile(layout, node, args.loglevel),
            end="",
        )
        return
    if args.print:
        print(json.dumps(layout.to_dict(), indent=2))
        for spec in layout.workers:
            env = " ".join(f"{k}={v}" for k, v in worker_env(spec, cpu_threads_per_worker(layout)).items())
            print(env, " ".join(worker_argv(spec, args.loglevel)))
        refuse_unfit_layout(layout)
        return
    refuse_unfit_layout(layout)
    supervisor = Supervisor()
    start_workers(supervisor, layout, args.loglevel)
    supervisor.run_forever()


if __name__ == "__main__":
    main()
