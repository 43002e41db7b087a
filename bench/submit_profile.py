"""Where the API's submit time goes: py-spy samples of the live API workers under `bench.overhead`'s submit load.

    python -m bench.submit_profile [--clients 8] [--requests 400] [--top 30] [--paused]

Starts the real stack as `bench.overhead` does (its own Redis, SQLite unless DATABASE_URL is given in the
environment of this command, simulated cards), runs the same submit load, and meanwhile samples every
gunicorn worker with py-spy (requirements-dev.txt). Prints the load's figures, then the functions that
hold the most samples: by self time and inclusive (each function counted once per stack), as a share of
all samples taken in the API workers, idle event-loop waits included (they show as `select`/`poll`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.livestack import live_stack
from bench.overhead import ms, stack_env, submit_load, workers_paused
from genserver.scheduling.simulator import pct


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: make .venv/.installed (requirements-dev.txt)")
    return found


def read_stacks(paths: list[Path]) -> collections.Counter[tuple[str, ...]]:
    """py-spy's raw (collapsed) output: `frame;frame;... count` lines, outermost frame first."""
    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
    for path in paths:
        for line in path.read_text().splitlines():
            frames, _, count = line.rpartition(" ")
            if frames and count.isdigit():
                stacks[tuple(frames.split(";"))] += int(count)
    return stacks


def tops(stacks: collections.Counter[tuple[str, ...]], n: int) -> tuple[list, list, int]:
    total = sum(stacks.values())
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for frames, count in stacks.items():
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return own.most_common(n), inclusive.most_common(n), total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--paused", action="store_true", help="workers paused: the API alone (bench.overhead)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second per worker")
    parser.add_argument(
        "--gil", action="store_true", help="only the thread holding the GIL: the API's Python CPU, no waits"
    )
    args = parser.parse_args(argv)
    out_dir = Path(tempfile.mkdtemp(prefix="genserver-profile-"))
    with live_stack(stack_env()) as stack, contextlib.ExitStack() as logs:
        submit_load(stack, args.clients, 40)  # warm: connections, imports, first queries
        pids = stack.api_worker_pids()
        spies = [
            subprocess.Popen(
                [
                    py_spy(),
                    "record",
                    "--format",
                    "raw",
                    "--function",
                    "--nonblocking",
                    "--rate",
                    str(args.rate),
                    *(["--gil"] if args.gil else []),
                    "-o",
                    str(out_dir / f"{pid}.txt"),
                    "-p",
                    str(pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=logs.enter_context(open(out_dir / f"{pid}.log", "w")),
            )
            for pid in pids
        ]
        with workers_paused() if args.paused else contextlib.nullcontext():
            latencies, codes, throughput = submit_load(stack, args.clients, args.requests)
        for spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
        for spy in spies:
            spy.wait(timeout=60)
    print(
        f"submit under {args.clients} clients: P50 {ms(latencies, 0.5)}  P99 {ms(latencies, 0.99)}  "
        f"{throughput:.0f} req/s  codes {codes}  (API workers sampled: {len(pids)})"
    )
    own, inclusive, total = tops(read_stacks(sorted(out_dir.glob("*.txt"))), args.top)
    if not total:
        raise SystemExit(f"py-spy took no sample; see {out_dir}/*.log")
    print(f"\n{total} samples; self time:")
    for frame, count in own:
        print(f"{count / total:6.1%}  {frame}")
    print("\ninclusive:")
    for frame, count in inclusive:
        print(f"{count / total:6.1%}  {frame}")
    print(
        f"\n(raw stacks in {out_dir}; P50/P99 from {len(latencies)} submits, "
        f"{pct(latencies, 0.5) * 1000:.1f} ms median)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
