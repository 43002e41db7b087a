"""The cancel and new-total flags a running chunk checks before every step, pushed to the cards as they change.

A running job stops within one step of its cancel, or of a new step total (POST /steps/), so its card checks
both flags before every step. Reading them from Redis each time cost a round trip per step of every running job,
the largest part of the service's own work per step on a fast model. So the writer raises a flag and names the
job on FLAGS_CHANNEL in one transaction, and each card process keeps one subscription to it (`FlagWatch`):
before a step the card drains what has arrived (a non-blocking look at a socket, no round trip) and reads the
flags from Redis only for a job named there, for a job it has not read since its subscription was last
confirmed, and at least every GENSERVER_FLAG_RECHECK seconds (settings.FLAG_RECHECK_SECONDS).

Why a check without a read is as good as one: Redis delivers a PUBLISH to every subscriber before it answers the
writer, and the flag is set in the same transaction, so a flag raised before the check began was either seen by
the job's last read or has been announced on the card's socket by the time the check looks. A subscription that
breaks (its reconnection re-subscribes) makes every tracked job read again once the new one is confirmed; one
that dies without an error is what the periodic read covers. Flags written straight into Redis, without the
announcement, are seen at that periodic read, so write them with `raise_cancel` and `raise_new_total`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import redis
from django.conf import settings

from genserver.redis_client import CANCEL_KEY, STEPS_KEY, client

log = logging.getLogger(__name__)

FLAGS_CHANNEL = "genserver:flags"  # the job id of every flag raised
FLAG_TTL_SECONDS = 7 * 24 * 3600  # a flag outlives any job that could read it; the job's end deletes the cancel


def raise_cancel(job_id: object) -> None:
    """Flag the job cancelled for the card running it (it stops before its next step)."""
    _raise(CANCEL_KEY.format(job_id=job_id), "1", job_id)


def raise_new_total(job_id: object, steps: int) -> None:
    """Flag the job's new step total for the card running it (it hands the job back before its next step)."""
    _raise(STEPS_KEY.format(job_id=job_id), str(steps), job_id)


def _raise(key: str, value: str, job_id: object) -> None:
    pipe = client().pipeline(transaction=True)  # the flag is set before any subscriber hears of it
    pipe.set(key, value, ex=FLAG_TTL_SECONDS)
    pipe.publish(FLAGS_CHANNEL, str(job_id))
    pipe.execute()


def read_flags(job_id: object) -> tuple[bytes | None, bytes | None]:
    """(cancel flag, latest total) of the job, straight from Redis: one round trip."""
    cancelled, total = client().mget(CANCEL_KEY.format(job_id=job_id), STEPS_KEY.format(job_id=job_id))
    return cancelled, total


# After a subscription failed, the card reads the flags before every step for this long before it subscribes
# again: a Redis that refuses or drops subscriptions costs a round trip per step, not a connection attempt per step.
RETRY_SECONDS = 5.0


class _Subscription(redis.client.PubSub):
    """A PubSub that tells its watch when its connection (re)connects, before it re-subscribes: announcements
    published while it was down are lost, so nothing it knew holds until the new subscription is confirmed."""

    def __init__(self, watch: FlagWatch) -> None:
        super().__init__(client().connection_pool)
        self._watch = watch

    def on_connect(self, connection) -> None:
        self._watch._unconfirm()
        super().on_connect(connection)


class FlagWatch:
    """One card's view of its running jobs' flags (one per thread: `watch`).

    `track` a job when its chunk task takes it and `untrack` it when the task ends; `current` before each step
    returns the job's flags, read from Redis when they may have changed, or None when they have not since the
    last read (which found nothing that stopped the job, or it would have left).
    """

    def __init__(self, recheck_seconds: float | None = None) -> None:
        self.recheck_seconds = settings.FLAG_RECHECK_SECONDS if recheck_seconds is None else recheck_seconds
        self.reads = 0  # the flags' reads from Redis (round trips) it made
        self._subscription: _Subscription | None = None
        self._generation = 0  # counts the confirmed subscriptions: a read under an older one is not trusted
        self._confirmed = False
        self._retry_at = 0.0  # after a failed subscription, the next try (meanwhile every check reads Redis)
        # job id → (generation, monotonic time) of its last read under a confirmed subscription; None: read next
        self._tracked: dict[str, tuple[int, float] | None] = {}

    def track(self, job_id: object) -> None:
        self._tracked.setdefault(str(job_id), None)

    def untrack(self, job_id: object) -> None:
        self._tracked.pop(str(job_id), None)

    def subscribe(self, timeout: float = 1.0) -> bool:
        """Subscribe now and wait up to `timeout` seconds for the confirmation (a card process does at its start,
        so its first job's steps read no more than later ones'). Whether it came."""
        deadline = time.monotonic() + timeout
        self._drain()
        while not self._confirmed and (left := deadline - time.monotonic()) > 0:
            connection = self._subscription.connection if self._subscription is not None else None
            if connection is not None:
                with contextlib.suppress(redis.RedisError, OSError):
                    connection.can_read(timeout=min(left, 0.05))
            else:
                time.sleep(min(left, 0.05))  # the subscription failed: try again shortly
            self._drain()
        return self._confirmed

    def current(self, job_id: object) -> tuple[bytes | None, bytes | None] | None:
        """The job's (cancel flag, latest total) when they may have changed since its last read, else None."""
        key = str(job_id)
        self._drain()
        last = self._tracked.get(key)
        if (
            last is not None
            and self._confirmed
            and last[0] == self._generation
            and time.monotonic() - last[1] < self.recheck_seconds
        ):
            return None
        values = read_flags(job_id)
        self.reads += 1
        if key in self._tracked:
            self._tracked[key] = (self._generation, time.monotonic()) if self._confirmed else None
        return values

    def _drain(self) -> None:
        """Take in what the subscription has delivered, without waiting; (re)subscribe when there is none."""
        if self._subscription is None and time.monotonic() < self._retry_at:
            return
        try:
            if self._subscription is None:
                self._subscription = _Subscription(self)
                self._subscription.subscribe(FLAGS_CHANNEL)  # confirmed by the message read below, or later
            subscription = self._subscription
            while True:
                message = subscription.get_message(timeout=0)
                if message is None:
                    connection = subscription.connection
                    if connection is None or not connection.can_read(timeout=0):
                        return  # (a health check's answer also reads as None: look again while data waits)
                    continue
                if message["type"] == "subscribe":
                    self._confirmed, self._generation = True, self._generation + 1
                elif message["type"] == "message":
                    job = message["data"].decode()
                    if job in self._tracked:
                        self._tracked[job] = None
        except (redis.RedisError, OSError):
            log.warning("the flags' subscription failed; reading the flags from Redis until it is back", exc_info=True)
            self._drop()
            self._retry_at = time.monotonic() + RETRY_SECONDS

    def close(self) -> None:
        """Drop the subscription; the next check subscribes again."""
        self._drop()

    def _unconfirm(self) -> None:
        self._confirmed = False

    def _drop(self) -> None:
        subscription, self._subscription, self._confirmed = self._subscription, None, False
        if subscription is not None:
            try:
                subscription.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped either way
                pass


_local = threading.local()
# A forked child (a prefork pool's, the zygote's) starts without its parent's watch: the socket is the parent's.
os.register_at_fork(after_in_child=lambda: _local.__dict__.pop("watch", None))


def watch() -> FlagWatch:
    """This thread's FlagWatch (a card runs its chunks on one thread; a pool of threads gets one each)."""
    found = getattr(_local, "watch", None)
    if found is None:
        found = _local.watch = FlagWatch()
    return found
