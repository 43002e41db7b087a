"""The overload cap in the live service: beat decides it on every reaper tick, workers keep to it at claim.

The rule is the simulator's (scheduling/overload.py): while a new long job's
expected wait over every live card passes the engage share of the long limit,
at most N−1 of the N live cards that take long work run it, until the wait
falls below the release share. The state lives in Redis (LONG_CAP_KEY) with a
time to live of a few ticks, so a cluster whose beat stops fails open: every
card takes long work again. Admission, queue positions and ETAs count the
capped capacity while it holds (selectors.live_capacity); a worker at the cap
hands a long chunk back and stops consuming long queues until the cap lets it
(workers/long_cap.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from django.conf import settings
from django.utils import timezone

from genserver import deployment
from genserver.jobs import selectors
from genserver.redis_client import LONG_CAP_KEY, client as redis_client
from genserver.scheduling.admission import expected_wait
from genserver.scheduling.classes import LONG, priority_for
from genserver.scheduling.overload import long_cards

log = logging.getLogger(__name__)
STATE_TICKS = 5  # the state outlives this many reaper ticks: a stopped beat lets go of the cap soon after


def update_long_cap() -> selectors.LongCapState:
    """Decide the cap from the backlog and the live cards (uncapped), store it, and return it."""
    policy = deployment.long_cap_policy()
    capacity = selectors.live_capacity(capped=False)
    cards = long_cards(capacity)
    before = selectors.long_cap_state()
    if policy is None or cards < 2:  # one card: capping it would stop long work altogether
        state = selectors.LongCapState(long_cards=cards)
    else:
        thresholds = deployment.thresholds()
        new_long = priority_for(LONG, thresholds.medium, False, thresholds)  # as the simulator asks
        wait = expected_wait(LONG, new_long, selectors.backlog_items(), capacity)
        engaged = policy.engaged(before.engaged, wait, deployment.limits().long)
        state = selectors.LongCapState(engaged, policy.cap(cards), cards, round(wait, 3), before.changed_at)
    if state.engaged != before.engaged:
        state = selectors.LongCapState(**(asdict(state) | {"changed_at": timezone.now().isoformat()}))
        log.info(
            "overload cap %s: a new long job would wait %.0f s (limit %.0f s); long work on %d of %d cards",
            "engaged" if state.engaged else "released",
            state.long_wait_seconds,
            deployment.limits().long,
            state.cap if state.engaged else cards,
            cards,
        )
    ttl = max(10.0, STATE_TICKS * float(settings.REAPER_INTERVAL_SECONDS))
    redis_client().set(LONG_CAP_KEY, json.dumps(asdict(state)), px=int(ttl * 1000))
    selectors.forget_cluster_read()  # this process's next picture has it
    return state
