"""A real S3 API for tests: moto's standalone server on loopback, reached by boto3 over HTTP.

    with MotoServer() as server:              # `moto_server -H 127.0.0.1 -p <free port>`
        server.create_bucket("genserver-test")
        env = server.env("genserver-test", prefix="run-1")   # GENSERVER_STORAGE=s3 and the AWS_* it needs

`env` is what a process needs to run on that store (the test process through
monkeypatch, the stack's workers and beat, a launcher of the two-node drill).
The fixtures `s3_server` and `storage_backend` in tests/conftest.py use it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.waits import wait_for
from workers.bundled_redis import free_port

BOOT_SECONDS = 60.0  # moto imports Flask and every service model: seconds on a busy machine
# moto accepts any credentials; boto3 needs some, and a region, to sign requests.
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _moto_server_argv(port: int) -> list[str]:
    script = Path(sys.executable).with_name("moto_server")
    command = str(script) if script.exists() else shutil.which("moto_server")
    if command is None:
        raise RuntimeError("moto_server is not installed: pip install -r requirements-dev.txt (moto[server])")
    return [command, "-H", "127.0.0.1", "-p", str(port)]


class MotoServer:
    """moto's S3 server in its own process group on 127.0.0.1:<free port>, stopped on exit."""

    def __init__(self, boot_timeout: float = BOOT_SECONDS) -> None:
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            _moto_server_argv(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            wait_for(self._answers, boot_timeout, interval=0.1, what=f"moto_server on {self.endpoint_url}")
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"moto_server exited with {self.process.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # it answered
        except OSError:
            return False

    def client(self):
        """A boto3 S3 client of this server (for setting up buckets and peeking at objects)."""
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=TEST_CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def create_bucket(self, bucket: str) -> str:
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def env(self, bucket: str, prefix: str = "") -> dict[str, str]:
        """The variables that put a process's storage on this server's `bucket` under `prefix`."""
        return {
            "GENSERVER_STORAGE": "s3",
            "GENSERVER_S3_BUCKET": bucket,
            "GENSERVER_S3_PREFIX": prefix,
            "GENSERVER_S3_ENDPOINT_URL": self.endpoint_url,
            **TEST_CREDENTIALS,
        }

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process.wait()

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
