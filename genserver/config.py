"""Strict readers of the environment, and the settings of the parts that run without Django.

`genserver/settings.py` reads every Django-side `GENSERVER_*` variable through
the helpers here. This module itself imports no Django, so the parts that must
not (the model runtime in `workers/runtime`, the launcher's per-worker
variables, the processes the launcher starts) read their few variables through
the functions at the bottom, and settings.py calls the same functions once so
that `manage.py check` and `make up` refuse a bad value before anything starts.

A malformed value is an error, never a silent default: `GENSERVER_WEBHOOK_ALLOW_PRIVATE=ture`
raises `SettingsError` naming the variable and what it accepts. Entry points
(`manage.py`, `python -m workers.stack`, `python -m workers.launcher`) print it as
one line, `genserver: NAME: problem (accepted: ...)`, and exit with status 2.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tomllib
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SETTINGS_ERROR_EXIT_STATUS = 2  # the status of a usage error, as argparse uses

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class SettingsError(ValueError):
    """A `GENSERVER_*` (or other) environment variable holds a value the service cannot use."""

    def __init__(self, name: str, problem: str, accepted: str) -> None:
        self.name = name
        one_line = " ".join(f"{name}: {problem} (accepted: {accepted})".split())
        super().__init__(one_line)


@contextmanager
def exit_on_settings_error() -> Iterator[None]:
    """Turn a SettingsError raised inside into one line on stderr and exit status 2.

    Wrap an entry point's start-up in it, before it starts any process, so a typo
    costs one readable line instead of a traceback after Redis and the API are up.
    """
    try:
        yield
    except SettingsError as exc:
        print(f"genserver: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(SETTINGS_ERROR_EXIT_STATUS) from None


def _raw(name: str) -> str | None:
    """The variable's value, stripped; None when unset or blank (blank means "use the default")."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def env_str(name: str, default: str) -> str:
    raw = _raw(name)
    return default if raw is None else raw


def env_bool(name: str, default: bool) -> bool:
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise SettingsError(name, f"{raw!r} is not a boolean", "1/0, true/false, yes/no, on/off")


def _range_text(minimum: float | None, maximum: float | None, above: float | None) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above:g}")
    if minimum is not None:
        parts.append(f">= {minimum:g}")
    if maximum is not None:
        parts.append(f"<= {maximum:g}")
    return " and ".join(parts)


def _check_range(
    name: str, value: float, kind: str, minimum: float | None, maximum: float | None, above: float | None
) -> None:
    if (
        (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
        or (above is not None and value <= above)
    ):
        raise SettingsError(name, f"{value:g} is out of range", f"{kind} {_range_text(minimum, maximum, above)}")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = env_optional_int(name, minimum=minimum, maximum=maximum)
    return default if value is None else value


def env_optional_int(name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    """A whole number, or None when unset (for "unset means computed" knobs)."""
    raw = _raw(name)
    if raw is None:
        return None
    kind = "a whole number" + (f" {_range_text(minimum, maximum, None)}" if (minimum, maximum) != (None, None) else "")
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(name, f"{raw!r} is not a whole number", kind) from None
    _check_range(name, value, "a whole number", minimum, maximum, None)
    return value


def env_float(
    name: str, default: float, *, minimum: float | None = None, maximum: float | None = None, above: float | None = None
) -> float:
    """A finite number; `above` is an exclusive lower bound (a time scale must be > 0)."""
    raw = _raw(name)
    if raw is None:
        return default
    kind = "a number" + (f" {_range_text(minimum, maximum, above)}" if (minimum, maximum, above) != (None,) * 3 else "")
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(name, f"{raw!r} is not a number", kind) from None
    if not math.isfinite(value):
        raise SettingsError(name, f"{raw!r} is not a finite number", kind)
    _check_range(name, value, "a number", minimum, maximum, above)
    return value


def env_choice(name: str, default: str, choices: Sequence[str]) -> str:
    """One of `choices`, matched without regard to case, returned as spelled in `choices`."""
    raw = _raw(name)
    if raw is None:
        return default
    for choice in choices:
        if raw.lower() == choice.lower():
            return choice
    raise SettingsError(name, f"{raw!r} is not one of the choices", ", ".join(choices))


def env_path(name: str, default: Path) -> Path:
    """A filesystem path (`~` expanded, made absolute); it need not exist yet."""
    raw = _raw(name)
    return (default if raw is None else Path(raw).expanduser()).resolve()


def env_url(name: str, default: str, schemes: Sequence[str] = ("http", "https")) -> str:
    """An absolute URL with one of `schemes` and a host, without a trailing slash ("" when unset)."""
    from urllib.parse import urlsplit

    raw = _raw(name)
    if raw is None:
        return default
    parts = urlsplit(raw)
    if parts.scheme not in schemes or not parts.netloc:
        raise SettingsError(
            name, f"{raw!r} is not an absolute URL", f"{' or '.join(schemes)} URLs such as https://gen.example.com"
        )
    return raw.rstrip("/")


def env_pools(name: str = "GENSERVER_POOLS") -> str:
    """The pool layout's spec (inline JSON or a .json/.toml path), checked by parsing it; "" when unset."""
    from genserver.scheduling.pools import load_layout

    raw = _raw(name)
    if raw is None:
        return ""
    try:
        load_layout(raw, num_gpus=0)
    except (ValueError, OSError) as exc:
        problem = str(exc).replace(f"{name} names ", "")
        if isinstance(exc, json.JSONDecodeError | tomllib.TOMLDecodeError):
            problem = f"not valid {'JSON' if isinstance(exc, json.JSONDecodeError) else 'TOML'} ({exc})"
        raise SettingsError(
            name,
            problem,
            'inline JSON {"workers": [{"name": "gpu0", "queues": ["short", "medium", "long"], '
            '"devices": [0]}, ...]} or the path of a .json/.toml file with the same; '
            "unset for the generated layout",
        ) from None
    return raw


def env_registry(name: str, default: str) -> str:
    """Model registry files joined by os.pathsep, checked by reading them (a missing file or a bad entry)."""
    from genserver.registry import RegistryError, load_registry

    raw = env_str(name, default)
    try:
        load_registry(raw)
    except (RegistryError, OSError, ValueError) as exc:  # tomllib's decode error is a ValueError
        problem = str(exc).replace("; set GENSERVER_REGISTRY to a TOML file", "")
        raise SettingsError(
            name,
            problem,
            f"TOML files in genserver/registry.toml's format, joined by "
            f"{os.pathsep!r} (later files add or replace models)",
        ) from None
    return raw


# --- The Django-free parts' settings ---------------------------------------------------------
# Read at call time: the launcher sets some of them per worker process, and the runtime reads
# them in that process. genserver/settings.py calls each once, so a bad value stops start-up.


def data_dir() -> Path:
    """Where everything the service writes lives (GENSERVER_DATA_DIR, default ./var of the checkout)."""
    return env_path("GENSERVER_DATA_DIR", BASE_DIR / "var")


def derived_redis_port(directory: Path) -> int:
    """The bundled Redis's port for a data directory: 6389 for the default ./var, one of 6390-7389 for
    any other, so a second stack with its own GENSERVER_DATA_DIR never meets the first one's Redis
    (two directories share a port 1 time in 1,000: `make up` then refuses to start, naming the variable)."""
    if directory == (BASE_DIR / "var").resolve():
        return 6389
    return 6390 + zlib.crc32(str(directory).encode()) % 1000


def embedded_redis_port() -> int:
    """GENSERVER_EMBEDDED_REDIS_PORT, else the port the data directory derives."""
    return env_int("GENSERVER_EMBEDDED_REDIS_PORT", derived_redis_port(data_dir()), minimum=1, maximum=65535)


def api_port() -> int:
    return env_int("GENSERVER_PORT", 8000, minimum=1, maximum=65535)


def flower_port() -> int:
    return env_int("FLOWER_PORT", 5555, minimum=1, maximum=65535)


def flower_address() -> str:
    """The address `make up` binds Flower to (127.0.0.1: this machine only)."""
    return env_str("FLOWER_ADDRESS", "127.0.0.1")


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP address or a host name) reaches this machine only."""
    import ipaddress

    if address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume others reach it


def flower_basic_auth() -> str:
    """Flower's logins, `user:password[,user:password...]` (Flower reads the same variable itself); "" is
    allowed only while Flower listens on a loopback address."""
    raw = env_str("FLOWER_BASIC_AUTH", "")
    pairs = [p for p in raw.split(",") if p]
    if any(":" not in p or not p.split(":", 1)[0] or not p.split(":", 1)[1] for p in pairs):
        raise SettingsError("FLOWER_BASIC_AUTH", "is not user:password pairs", "user:password[,user:password...]")
    address = flower_address()
    if not pairs and not is_loopback(address):
        raise SettingsError(
            "FLOWER_BASIC_AUTH",
            f"is unset but FLOWER_ADDRESS={address} lets other machines reach Flower",
            "user:password (Flower's basic auth), or FLOWER_ADDRESS=127.0.0.1",
        )
    return raw


def metrics_token() -> str:
    """The bearer secret Prometheus sends to /metrics (and to a worker node's `python -m genserver.metrics
    serve`); "" → the API's /metrics answers staff only, and a node's exporter listens on loopback only."""
    return env_str("GENSERVER_METRICS_TOKEN", "")


def api_workers() -> int:
    return env_int("GENSERVER_API_WORKERS", 2, minimum=1)


def api_threads() -> int:
    """Threads per API process serving the quick requests (genserver/serving.py). More serve more at once while
    the database or Redis is slow to answer (across a network), each holding a database connection; on a
    CPU-bound machine they contend for the interpreter, and a thread holding a write lock (SQLite's turn, the
    owner's row on PostgreSQL) waits behind the others: 8 instead of 2 took a 2-core machine's submits from
    112-120 to 86-93 per second on PostgreSQL (docs/BENCHMARKS.md, "Submit throughput, stop 43")."""
    return env_int("GENSERVER_API_THREADS", 2, minimum=1)


def cluster_read_seconds() -> float:
    """How long an API process reuses its read of the cluster's picture in Redis (the live cards, the overload
    cap, the learned stage seconds: `selectors.capacity.cluster_reads`) and of the decode workers' queue
    (`selectors.decode_queue.line`), which every submit and every job's answer needs. Longer saves a Redis round
    trip (at 200 submits/s, about 5 % of the API's CPU and the wait for Redis) and a database read per request; the
    answers then see a card come or go, the cap engage or let go, a newly learned stage time, or a decode published
    or done up to that much later (a card's liveness itself is refreshed every 5 s and expires after 15). 0 reads
    them at every request."""
    return env_float("GENSERVER_CLUSTER_READ_SECONDS", 0.5, minimum=0.0, maximum=5.0)


def worker_pool() -> str:
    """Celery's execution pool for each worker: `solo` runs tasks in the worker process itself."""
    return env_choice("GENSERVER_WORKER_POOL", "solo", ("solo", "prefork", "threads"))


def worker_forkserver() -> str:
    """Whether workers fork from a zygote that imported torch once (workers/zygote.py): auto = on CPU layouts."""
    return env_choice("GENSERVER_WORKER_FORKSERVER", "auto", ("auto", "on", "off"))


def worker_loglevel() -> str:
    return env_choice("GENSERVER_WORKER_LOGLEVEL", "INFO", LOG_LEVELS)


def torch_threads() -> int | None:
    """Torch threads per worker; None → the launcher shares the cores out."""
    return env_optional_int("GENSERVER_TORCH_THREADS", minimum=1)


def worker_queues() -> list[str]:
    """The queues this worker consumes (set by the launcher; empty for a worker started by hand)."""
    return [q for q in env_str("GENSERVER_WORKER_QUEUES", "").split(",") if q]


def worker_models() -> list[str]:
    """The only models this worker loads (set by the launcher for an entry with `models`; empty: any)."""
    return [m for m in env_str("GENSERVER_WORKER_MODELS", "").split(",") if m]


def group_size() -> int:
    """k of this worker's card group (set by the launcher for a pool entry with k devices)."""
    return env_int("GENSERVER_GROUP_SIZE", 1, minimum=1)


def group_timeout_seconds() -> float:
    return env_float("GENSERVER_GROUP_TIMEOUT_SECONDS", 300.0, above=0)


def card_gib() -> float | None:
    """Card memory the launcher's memory plan checks a layout against (None: ask nvidia-smi)."""
    if not env_str("GENSERVER_CARD_GIB", ""):
        return None
    return env_float("GENSERVER_CARD_GIB", 0.0, above=0)


def embeddings_cache_bytes() -> int:
    """Bytes of prompt embeddings a denoise worker keeps in host memory after reading them (0: none).

    A first chunk of a known prompt and every chunk resumed after a yield read them again. More: fewer
    storage reads (a deserialisation each; a GET from an object store); less: host memory left to the rest.
    Read here, not from Django settings, so the runtime runs without Django (bench/gpu_bench.py).
    """
    return env_int("GENSERVER_EMBEDDINGS_CACHE_BYTES", 256 * 1024**2, minimum=0)


def png_compress_level() -> int:
    """zlib level of the PNGs the workers write (outputs on the decode worker, previews on the card, posters).

    Higher: smaller files, more CPU per image; PIL's own default is 6. At 1 a smooth 1024² picture encoded in
    91 ms instead of 251 for 16 % more bytes, a grainy one 10 % faster for 3 % more (`python -m bench.png_level`,
    docs/BENCHMARKS.md "PNG level"): the encode is on every image's path to `succeeded`, and a preview's is on
    the card's. 0 stores uncompressed (fastest, 1.3-8.6× larger).
    """
    return env_int("GENSERVER_PNG_COMPRESS_LEVEL", 1, minimum=0, maximum=9)


def vae_tile_above_pixels() -> int:
    """Pixels per frame above which the VAE decodes in tiles (0: always tile)."""
    return env_int("GENSERVER_VAE_TILE_ABOVE_PIXELS", 768 * 768, minimum=0)


# --- Object storage (issue 12): where job data lives -----------------------------------------
# Read by genserver.storage at call time (workers and the API alike), and once by settings.py.
STORAGE_BACKENDS = ("local", "s3")
OUTPUT_DELIVERIES = ("stream", "presigned")


def storage_backend() -> str:
    """`local`: a directory (GENSERVER_STORAGE_DIR); `s3`: an S3-compatible bucket shared by every node."""
    return env_choice("GENSERVER_STORAGE", "local", STORAGE_BACKENDS)


def storage_dir() -> Path:
    """The local backend's directory (default: storage/ under GENSERVER_DATA_DIR)."""
    return env_path("GENSERVER_STORAGE_DIR", data_dir() / "storage")


def s3_bucket() -> str:
    """The bucket of the s3 backend; required when GENSERVER_STORAGE=s3."""
    bucket = env_str("GENSERVER_S3_BUCKET", "")
    if not bucket and storage_backend() == "s3":
        raise SettingsError(
            "GENSERVER_S3_BUCKET",
            "is unset but GENSERVER_STORAGE=s3",
            "the name of an existing bucket, such as genserver-data",
        )
    return bucket


def s3_prefix() -> str:
    """Key prefix inside the bucket (no leading or trailing slash; "" puts keys at the bucket's root)."""
    return env_str("GENSERVER_S3_PREFIX", "").strip("/")


def s3_endpoint_url() -> str:
    """The S3 API's URL for MinIO, R2, Ceph or a test server ("" → AWS's own endpoint for the region)."""
    return env_url("GENSERVER_S3_ENDPOINT_URL", "")


def output_delivery() -> str:
    """How an output reaches its owner after the API's owner check: streamed through the API, or a
    redirect to a short-lived presigned URL of the object store (s3 only; local always streams)."""
    return env_choice("GENSERVER_OUTPUT_DELIVERY", "stream", OUTPUT_DELIVERIES)


def output_url_ttl_seconds() -> int:
    """How long a presigned output URL stays valid."""
    return env_int("GENSERVER_OUTPUT_URL_TTL", 300, minimum=1, maximum=7 * 24 * 3600)


# --- Nodes (issue 12) --------------------------------------------------------------------------
_NODE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")


def node() -> str:
    """This machine's name in the cluster (GENSERVER_NODE, default the host name): it qualifies every
    worker's Celery hostname, liveness key, lease owner and heartbeat, so two nodes' `gpu0` stay apart."""
    import socket

    name = env_str("GENSERVER_NODE", "") or socket.gethostname().split(".")[0] or "localhost"
    if not set(name) <= _NODE_NAME_CHARS or len(name) > 64:
        raise SettingsError(
            "GENSERVER_NODE",
            f"{name!r} is not a node name",
            "up to 64 letters, digits, '.', '-' and '_' (it becomes part of Celery hostnames)",
        )
    return name
