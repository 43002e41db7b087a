"""The real ASGI server (uvicorn serving genserver.asgi) on a free port, for clients that need HTTP itself.

pytest-django's live_server is WSGI in a thread and cannot stream server-sent
events; this runs the app as `make up` does (ASGI), in its own process, with
the test session's environment (its database, Redis and storage). The
`asgi_server` fixture in tests/conftest.py starts one per session:

    def test_x(asgi_server):
        requests.get(f"{asgi_server.url}/healthz")
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from workers.bundled_redis import free_port

ROOT = Path(__file__).resolve().parents[2]
BOOT_SECONDS = 60.0  # Django's import and app setup on a busy 2-core machine


class AsgiServer:
    """uvicorn genserver.asgi:application on 127.0.0.1:<free port>; `url` once it answers /healthz."""

    def __init__(self, env: dict[str, str] | None = None, boot_timeout: float = BOOT_SECONDS) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environment = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "tests.settings"),
            **(env or {}),
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "genserver.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            cwd=ROOT,
            env=environment,
        )
        self._wait_ready(boot_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"uvicorn exited with status {self.process.returncode} before answering")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"uvicorn did not answer {self.url}/healthz within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
