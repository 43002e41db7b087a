"""One Redis connection pool per process, for flags, counters and worker heartbeats (not the broker)."""

from __future__ import annotations

from functools import lru_cache

import redis
from django.conf import settings

CANCEL_KEY = "genserver:cancel:{job_id}"
STEPS_KEY = "genserver:steps:{job_id}"  # the job's latest total; a worker running another total stops
CORRECTION_KEY = "genserver:step-correction"
# The wall seconds each model's jobs spend around their denoising steps, learned as they run
# (services/estimates.py), as "{model}:{stage}": LEAD_IN (its encode message published → its first chunk
# published), HOP (its first chunk published → its first step, on a card that was idle), BOUNDARY (one chunk's
# end: checkpoint and transition), STEP (what one step takes beyond its estimate: the service's own work per step,
# the progress callback and the cancel check, which the cost model leaves out and a simulated model never
# learns), TAIL (its decode published → it finished) and DECODE (a decode worker took it → it finished: the
# decode alone, without the wait for that worker). ETAs and quotes add them (selectors/positions.py; the wait
# for a decode worker: selectors/decode_queue.py).
STAGE_SECONDS_KEY = "genserver:stage-seconds"
LEAD_IN, HOP, BOUNDARY, STEP, TAIL, DECODE = "lead-in", "hop", "boundary", "step", "tail", "decode"
WORKER_KEY = "genserver:worker:{name}"  # a worker's liveness (genserver/liveness.py)
WORKERS_KEY = "genserver:workers"  # the names of the workers that wrote one lately, for the readers
LONG_CAP_KEY = "genserver:long-cap"  # the overload cap's state, written by beat (services/overload.py)
# A random value that changes whenever a token, a user or a quota row changes: the API processes' copies of
# those rows are used only under the value they were read under (jobs/selectors/access.py).
ACCESS_GENERATION_KEY = "genserver:access-generation"
# A job published one step ahead as the lightest user's (services/fairness.py) until its first chunk is claimed:
# while it waits, one card running another user's chunk cuts that chunk at its next step (tasks/denoise.py).
AHEAD_KEY = "genserver:ahead:{job_id}"
CUT_CLAIM_KEY = "genserver:cut:{message}"  # the card that cuts its chunk for a waiting message (one per message)
# A job whose encode is published announces its first chunk here until the chunk is published ({job_id: "priority
# time"} per denoise queue), so a card at a chunk boundary may hold for it (broker.should_yield); the card
# that holds for it claims it (one per job).
ARRIVING_KEY = "genserver:arriving:{queue}"
ARRIVING_CLAIM_KEY = "genserver:arriving-claim:{job_id}"
ARRIVED_KEY = "genserver:arrived:{job_id}"  # pushed once the announced chunk is published: wakes the holding card


@lru_cache(maxsize=1)
def client() -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5, health_check_interval=30
    )
