"""Reads: which jobs a user sees, the queue picture (positions, ETAs, backlog) from the database, the
capacity that serves it (the cards whose workers heartbeat, on every node), bounded waits, quotas and tokens.

The modules: `access` (per-process copies of the token and quota rows), `jobs` (one job), `positions` (the
queue picture at any depth), `capacity` (live cards and the overload cap), `overview` (GET /queues/ and
/models/, admission's headwind), `waits`, `quotas`, `tokens`. Callers use the names re-exported here; a test
that stands in for a read patches it in its module (e.g. `selectors.capacity.live_workers`), where its
callers look it up.
"""

from __future__ import annotations

from genserver.jobs.broker import broker_depth

from . import access, capacity, jobs, overview, positions, quotas, tokens, waits
from .capacity import (
    LongCapState,
    capacity_of,
    cards_running_long,
    forget_cluster_read,
    live_capacity,
    live_workers,
    long_cap_state,
    must_leave_long,
    nodes_overview,
)
from .jobs import jobs_listed_for, jobs_visible_to, model_of, queue_and_priority
from .overview import QUEUE_SUMMARY_FIELDS, queue_overview, step_time_corrections
from .positions import (
    NEAR_END,
    FairPicture,
    HeldRow,
    QueueSnapshot,
    WaitingGroup,
    backlog_items,
    fair_picture,
    headwind_for,
    held_rows,
    published_unstarted,
    running_jobs,
    unstarted_by_owner,
    waiting_groups,
)
from .quotas import (
    EffectiveQuota,
    LimitCounts,
    Usage,
    effective_quota,
    in_flight_jobs,
    limit_counts,
    next_utc_midnight,
    usage_of,
    usage_report,
)
from .tokens import api_tokens_of, live_api_tokens
from .waits import (
    WAIT_POLL_FIRST_SECONDS,
    WAIT_POLL_MAX_SECONDS,
    WAIT_SERVED_CHECK_SECONDS,
    nobody_serves,
    wait_for_terminal,
)

__all__ = [
    "EffectiveQuota",
    "FairPicture",
    "HeldRow",
    "LimitCounts",
    "LongCapState",
    "NEAR_END",
    "QUEUE_SUMMARY_FIELDS",
    "QueueSnapshot",
    "Usage",
    "WAIT_POLL_FIRST_SECONDS",
    "WAIT_POLL_MAX_SECONDS",
    "WAIT_SERVED_CHECK_SECONDS",
    "WaitingGroup",
    "access",
    "api_tokens_of",
    "backlog_items",
    "broker_depth",
    "capacity",
    "capacity_of",
    "cards_running_long",
    "forget_cluster_read",
    "effective_quota",
    "fair_picture",
    "headwind_for",
    "held_rows",
    "in_flight_jobs",
    "jobs",
    "jobs_listed_for",
    "jobs_visible_to",
    "limit_counts",
    "live_api_tokens",
    "live_capacity",
    "live_workers",
    "long_cap_state",
    "model_of",
    "must_leave_long",
    "next_utc_midnight",
    "nobody_serves",
    "nodes_overview",
    "overview",
    "positions",
    "queue_and_priority",
    "queue_overview",
    "quotas",
    "running_jobs",
    "published_unstarted",
    "unstarted_by_owner",
    "step_time_corrections",
    "tokens",
    "usage_of",
    "usage_report",
    "wait_for_terminal",
    "waiting_groups",
    "waits",
]
