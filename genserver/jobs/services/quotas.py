"""Quotas at submit: which models and lanes a user may use (403), and their limits (429), before anything is written.

A user's effective quota (`selectors.effective_quota`: their own row, else their
groups' most generous, else the settings) is checked in two places of `submit_job`:

* `check_allowed` before admission: a model or lane the quota does not list is
  a `NotAllowed` (403) naming the allowed ones, as is a job whose estimate alone
  is more than the whole daily card-seconds quota (no retry would help);
* `check_limits` inside the submit transaction, with the user's row locked
  (SELECT ... FOR UPDATE), so two concurrent submits cannot both take the last
  place: jobs in flight, submits in the rate window, card-seconds today. Each
  refusal is a `QuotaExceeded` (429) naming the limit, what is used, and when it
  resets (`Retry-After`).

Card-seconds: a job is charged its estimate (`estimated_seconds × clock_scale`,
wall seconds of one card) at submit, on its submit's UTC day; when it ends,
`settle` replaces the charge with its measured `card_seconds` (`_common.after_end`).
A leaf of the service (it imports only reads and the models), so `_common` calls `settle`.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connections, router
from django.db.models import F
from django.utils import timezone

from genserver.jobs import selectors
from genserver.jobs.models import TERMINAL, Job
from genserver.jobs.selectors import EffectiveQuota

UNLIMITED = 0  # a limit of 0 is no limit (as in the settings)


class QuotaExceeded(Exception):
    """A limit of the user's quota is reached (→ 429 with Retry-After); nothing was recorded.

    `reason` is the API's stable code: too_many_in_flight, rate_limited or card_seconds_per_day.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        limit: float,
        used: float,
        retry_after_seconds: int,
        resets_at: datetime | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.limit = limit
        self.used = used
        self.retry_after_seconds = retry_after_seconds
        self.resets_at = resets_at


class InFlightLimitReached(QuotaExceeded):
    """The user already has their limit of unfinished jobs (→ 429 with Retry-After)."""

    def __init__(self, limit: int, in_flight: int, retry_after_seconds: int) -> None:
        super().__init__(
            "too_many_in_flight",
            f"You have {in_flight} unfinished jobs; at most {limit} may be queued or running at once. "
            "Wait for one to finish or cancel one.",
            limit,
            in_flight,
            retry_after_seconds,
        )
        self.in_flight = in_flight


class NotAllowed(Exception):
    """The user's quota does not allow this request (→ 403); nothing was recorded.

    `reason`: model_not_allowed, lane_not_allowed, or exceeds_daily_quota (the job alone costs more
    card-seconds than the whole day's quota); `field` names the request field to change.
    """

    def __init__(self, reason: str, field: str, message: str, allowed: list[str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field
        self.allowed = allowed


def charge_of(estimated_seconds: float, clock_scale: float) -> float:
    """Card-seconds charged at submit: the estimate in wall seconds of one card (the one clock)."""
    return estimated_seconds * clock_scale


def check_allowed(quota: EffectiveQuota, model: str, lane: str, charge: float) -> None:
    """Refuse (NotAllowed) a model or lane the quota does not list, or a job bigger than the daily quota."""
    if not quota.allows_model(model):
        raise NotAllowed(
            "model_not_allowed",
            "model",
            f"Your quota does not allow model {model!r}; allowed: {', '.join(quota.models)}.",
            list(quota.models),
        )
    if not quota.allows_lane(lane):
        raise NotAllowed(
            "lane_not_allowed",
            "lane",
            f"Your quota does not allow lane {lane!r}; allowed: {', '.join(quota.lanes)} (or leave `lane` out).",
            list(quota.lanes),
        )
    daily = quota.card_seconds_per_day
    if daily != UNLIMITED and charge > daily:
        raise NotAllowed(
            "exceeds_daily_quota",
            "steps",
            f"This job is estimated at {charge:.1f} card-seconds, more than your whole daily quota of "
            f"{daily:g}; ask for fewer steps, frames, outputs or a smaller size.",
        )


def _lock_owner_row(owner: Any) -> None:
    """Lock the owner's row until the transaction ends, so that the user's submits count their limits and their
    fair window one at a time. On SQLite there is nothing to lock: every transaction begins IMMEDIATE (the
    database's write lock, genserver/settings.py), so writers are one at a time already. Written as SQL: the
    ORM compiled the one-row select at every submit."""
    model = owner._meta.model  # not type(owner): a session-authenticated request.user is a lazy proxy (the web page)
    connection = connections[router.db_for_write(model)]
    if not connection.features.has_select_for_update:
        return
    quote = connection.ops.quote_name
    table, key = quote(model._meta.db_table), quote(model._meta.pk.column)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {key} FROM {table} WHERE {key} = %s FOR UPDATE", [owner.pk])


def check_limits(owner: Any, quota: EffectiveQuota, charge: float, now: datetime | None = None) -> None:
    """Inside submit_job's transaction: lock the owner's row, then refuse (QuotaExceeded) a job beyond
    the user's jobs in flight, submits per rate window, or card-seconds today.

    A job whose cancel was accepted no longer counts in flight. Retry-After: for jobs in
    flight, when the first of the user's jobs is expected to end (its ETA); for submits,
    when the oldest submit leaves the window; for card-seconds, the next 00:00 UTC.
    """
    _lock_owner_row(owner)
    now = now or timezone.now()
    counts = selectors.limit_counts(owner, quota, now)  # read no further than each limit
    limit = quota.max_jobs_in_flight
    if counts.in_flight is not None and counts.in_flight >= limit:
        in_flight = selectors.usage_of(owner, now).in_flight  # all of them, for the answer (a lowered limit)
        snapshot = selectors.QueueSnapshot.load()
        counted = selectors.in_flight_jobs(owner)
        etas = [eta for job in counted if (eta := snapshot.eta_seconds(job)) is not None]
        soonest = min(etas) if etas else 60.0  # no ETA: no worker serves their queues
        raise InFlightLimitReached(limit, in_flight, max(1, math.ceil(soonest)))
    limit = quota.submits_per_minute
    if counts.submits_in_window is not None and counts.submits_in_window >= limit:
        # The next submit fits once the oldest of the window's submits leaves it.
        window = float(settings.SUBMIT_RATE_WINDOW)
        resets_at = _oldest_of_last(owner, limit, now, window)
        wait = max(1, math.ceil((resets_at - now).total_seconds()))
        raise QuotaExceeded(
            "rate_limited",
            f"Too many submissions: at most {limit} jobs per {window:g} s; retry in {wait} s.",
            limit,
            counts.submits_in_window,
            wait,
            resets_at,
        )
    daily = quota.card_seconds_per_day
    used = counts.card_seconds_today
    if used is not None and used + charge > daily:
        resets_at = selectors.next_utc_midnight(now)
        wait = max(1, math.ceil((resets_at - now).total_seconds()))
        left = max(0.0, daily - used)
        raise QuotaExceeded(
            "card_seconds_per_day",
            f"This job is estimated at {charge:.1f} card-seconds and {left:.1f} of your {daily:g} per day "
            f"are left (used {used:.1f}); the quota resets at 00:00 UTC "
            f"(in {wait} s). Ask for less work (fewer steps, frames or outputs) or wait.",
            daily,
            round(used, 3),
            wait,
            resets_at,
        )


def _oldest_of_last(owner: Any, limit: int, now: datetime, window_seconds: float) -> datetime:
    """When the window has room again: the limit-th most recent submit's time + the window."""
    window = timedelta(seconds=window_seconds)
    recent = list(
        Job.objects.filter(owner_id=owner.pk, created_at__gte=now - window)
        .order_by("-created_at")
        .values_list("created_at", flat=True)[:limit]
    )
    return recent[-1] + window


def settle(job_id: Any) -> None:
    """Once a job is terminal: its charge becomes its measured card time (idempotent)."""
    Job.objects.filter(pk=job_id, status__in=TERMINAL).update(**settled_charge())


def settled_charge(added_seconds: float = 0.0) -> dict[str, Any]:
    """What `settle` assigns, for a terminal transition to carry in its own statement (no settle after it).
    `added_seconds`: the card seconds that statement adds to the job's own (its right-hand sides read the row as
    it was before the statement)."""
    return {"charged_card_seconds": F("card_seconds") + added_seconds if added_seconds else F("card_seconds")}
