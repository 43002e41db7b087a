"""Start the real service (`python -m workers.stack`, as `make up` does) for a benchmark, and stop it after.

Everything goes in a private data directory; the broker is the bundled Redis
unless REDIS_URL is set (then a private database number on it is used).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.bundled_redis import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LiveStack:
    url: str
    token: str
    env: dict[str, str]
    process: subprocess.Popen

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, Any, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null"), dict(resp.headers)
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null"), dict(err.headers)

    def api_worker_pids(self) -> list[int]:
        """The gunicorn workers under the stack's process: the children of its gunicorn master."""

        def children(pid: int) -> list[int]:
            out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
            return [int(p) for p in out.split()]

        def cmdline(pid: int) -> str:
            try:
                return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                return ""

        masters = [p for p in children(self.process.pid) if "gunicorn" in cmdline(p)]
        return [w for m in masters for w in children(m)]

    def api_cpu_seconds(self) -> float:
        """The CPU time (user + system) the API's workers have used so far, all of them together (Linux /proc)."""
        total = 0
        for pid in self.api_worker_pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # a worker that was just replaced
            total += int(fields[11]) + int(fields[12])  # utime, stime (after the command's closing paren)
        return total / os.sysconf("SC_CLK_TCK")

    def all_jobs(self) -> list[dict]:
        jobs, offset = [], 0
        while True:
            _, page, _ = self.request("GET", f"/api/v1/jobs/?limit=500&offset={offset}")
            jobs += page["results"]
            offset += len(page["results"])
            if not page["next"]:
                return jobs


def broker_url() -> tuple[str, dict[str, str]]:
    """(the Redis URL the stack will use, the env that makes it so): a private database on
    REDIS_URL's server when it is set (flushed first), else a bundled server on a free port."""
    given = os.environ.get("REDIS_URL")
    if given:
        import redis

        url = re.sub(r"/\d*$", "", given.rstrip("/")) + "/11"
        redis.Redis.from_url(url).flushdb()
        return url, {"REDIS_URL": url}
    port = free_port()
    return f"redis://127.0.0.1:{port}/0", {"GENSERVER_EMBEDDED_REDIS_PORT": str(port)}


@contextlib.contextmanager
def live_stack(env: dict[str, str], boot_timeout: float = 180) -> Iterator[LiveStack]:
    """The stack with `env` on top of a private data dir, ports and broker.

    Once it is up, this process's REDIS_URL points at the same broker (for
    Celery probes and event receivers) and Django is set up with it. The
    database is a private SQLite file unless `env` names a DATABASE_URL.
    """
    data_dir = tempfile.mkdtemp(prefix="genserver-bench-")
    port, flower = free_port(), free_port()
    redis_url, redis_env = broker_url()
    full = (
        os.environ.copy()
        | {
            "GENSERVER_DATA_DIR": data_dir,
            "GENSERVER_PORT": str(port),
            "FLOWER_PORT": str(flower),
            "GENSERVER_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
            # One benchmark user stands for many: per-user limits off.
            "GENSERVER_MAX_JOBS_IN_FLIGHT": "0",
            "GENSERVER_SUBMIT_RATE_LIMIT": "0",
        }
        | redis_env
        | env
    )
    if "REDIS_URL" not in redis_env:
        full.pop("REDIS_URL", None)
    if "DATABASE_URL" not in env:
        full.pop("DATABASE_URL", None)  # a private SQLite file: the benchmark never touches a shared database
    log = open(Path(data_dir) / "stack.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.stack"],
        cwd=ROOT,
        env=full,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    try:  # from here on, whatever happens (a failed boot, Ctrl-C while waiting) stops the stack
        token = ""
        deadline = time.monotonic() + boot_timeout
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(r"Token\s+(gs_[0-9A-Za-z]+)", line)  # services/tokens.py: gs_ + prefix + secret
            if match:
                token = match.group(1)
            if "Ctrl-C stops everything" in line or time.monotonic() > deadline:
                break
        if not token:
            raise RuntimeError(f"the stack did not come up; see {data_dir}/stack.log")
        # Keep reading its stdout (gunicorn's access log goes there) into a file: a pipe nobody reads fills at
        # 64 KB, and then every write to it blocks, the API workers' event loops included (gunicorn kills them
        # as hung).
        threading.Thread(
            target=_drain, args=(proc.stdout, Path(data_dir) / "stack.stdout.log"), daemon=True, name="stack-stdout"
        ).start()
        stack = LiveStack(f"http://127.0.0.1:{port}", token, full, proc)
        os.environ.update(
            {
                k: full[k]
                for k in ("GENSERVER_DATA_DIR", "GENSERVER_REGISTRY", "GENSERVER_TIME_SCALE", "DATABASE_URL")
                if k in full
            }
            | {"REDIS_URL": redis_url}
        )
        if "DATABASE_URL" not in full:
            os.environ.pop("DATABASE_URL", None)  # this process reads the stack's database too
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
        import django

        django.setup()
        wait_for_workers(stack)
        yield stack
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _drain(stream: Any, path: Path) -> None:
    """Copy the stack's stdout to `path` until it closes."""
    with open(path, "w") as out:
        for line in stream:
            out.write(line)


def as_user(stack: LiveStack, user: str, staff: bool = False) -> LiveStack:
    """The stack as `user` sees it: a token issued for them (`manage.py issue_token`, created if new)."""
    argv = [sys.executable, "manage.py", "issue_token", user] + (["--staff"] if staff else [])
    done = subprocess.run(argv, cwd=ROOT, env=stack.env, capture_output=True, text=True, check=True)
    return dataclasses.replace(stack, token=done.stdout.split()[-1])


def wait_for_workers(stack: LiveStack, timeout: float = 120) -> None:
    """Until every worker of the stack's layout (as its API reports it) is live: the suite's readiness wait."""
    from workers.local_workers import wait_until_live

    # The workers serving each class are staff's view of /queues/: ask as a staff user of the stack.
    _, queues, _ = as_user(stack, "bench-staff", staff=True).request("GET", "/api/v1/queues/")
    wait_until_live({name for q in queues for name in q["workers"]}, timeout, interval=0.5)
