"""The cancel and new-total flags as a card sees them (genserver/jobs/flags.py), on the real Redis: read once, then
only when announced, when the subscription came back, or when the safety interval has passed."""

from __future__ import annotations

import os
import uuid

import pytest

from genserver.jobs import flags
from genserver.redis_client import CANCEL_KEY, STEPS_KEY, client as redis_client
from tests.support.waits import wait_for

LONG = 3600.0  # a recheck interval no test waits out: what it shows comes from the announcements alone


@pytest.fixture
def job_id():
    job = str(uuid.uuid4())
    yield job
    redis_client().delete(CANCEL_KEY.format(job_id=job), STEPS_KEY.format(job_id=job))


def subscribed(recheck_seconds: float = LONG) -> flags.FlagWatch:
    watch = flags.FlagWatch(recheck_seconds=recheck_seconds)
    assert watch.subscribe(timeout=10), "the subscription was not confirmed"
    return watch


def test_a_tracked_job_is_read_once_and_then_not_until_announced(job_id):
    watch = subscribed()
    try:
        watch.track(job_id)
        assert watch.current(job_id) == (None, None) and watch.reads == 1  # its first check reads Redis
        assert [watch.current(job_id) for _ in range(50)] == [None] * 50 and watch.reads == 1  # no round trip
        flags.raise_cancel(job_id)
        # Announced before the writer was answered; the next check reads the flag (one more read, not one per call).
        assert wait_for(lambda: watch.current(job_id), 10, interval=0.001, what="the announced cancel") == (b"1", None)
        assert watch.reads == 2
    finally:
        watch.close()


def test_a_new_total_is_announced_like_a_cancel(job_id):
    watch = subscribed()
    try:
        watch.track(job_id)
        watch.current(job_id)
        flags.raise_new_total(job_id, 12)
        assert wait_for(lambda: watch.current(job_id), 10, interval=0.001, what="the new total") == (None, b"12")
        assert redis_client().ttl(STEPS_KEY.format(job_id=job_id)) > 0  # it expires like the cancel flag
    finally:
        watch.close()


def test_announcements_of_jobs_not_tracked_are_not_kept(job_id):
    watch = subscribed()
    try:
        mine = str(uuid.uuid4())
        watch.track(mine)
        watch.current(mine)
        flags.raise_cancel(job_id)  # another card's job
        flags.raise_cancel(mine)  # announced after it: once this one is read, the other was drained
        assert wait_for(lambda: watch.current(mine), 10, interval=0.001, what="the second announcement") == (b"1", None)
        assert watch.reads == 2 and set(watch._tracked) == {mine}  # the other neither read nor remembered
        redis_client().delete(CANCEL_KEY.format(job_id=mine))
        watch.untrack(mine)
        assert watch._tracked == {}
    finally:
        watch.close()


def test_a_broken_subscription_makes_every_tracked_job_read_again(job_id):
    """What was announced while the subscription was down is lost: the reconnection re-subscribes, and every
    tracked job is read from Redis until the new subscription is confirmed and once under it."""
    watch = subscribed()
    try:
        watch.track(job_id)
        watch.current(job_id)
        host, port = watch._subscription.connection._sock.getsockname()[:2]
        assert redis_client().client_kill_filter(_type="pubsub", addr=f"{host}:{port}") == 1
        # Raised while the subscription is down, without an announcement it could have heard.
        redis_client().set(CANCEL_KEY.format(job_id=job_id), "1", ex=60)
        assert wait_for(lambda: watch.current(job_id), 10, interval=0.001, what="the flag read after the break") == (
            b"1",
            None,
        )
        assert watch.subscribe(timeout=10), "the subscription did not come back"
        reads = watch.reads
        watch.current(job_id)  # once under the new subscription, then not until announced
        assert watch.current(job_id) is None and watch.reads == reads + 1
    finally:
        watch.close()


def test_a_flag_written_without_an_announcement_is_read_at_the_recheck(job_id):
    watch = subscribed(recheck_seconds=0.05)
    try:
        watch.track(job_id)
        watch.current(job_id)
        redis_client().set(CANCEL_KEY.format(job_id=job_id), "1", ex=60)  # not through raise_cancel
        assert wait_for(lambda: watch.current(job_id), 10, interval=0.01, what="the periodic read") == (b"1", None)
    finally:
        watch.close()


def test_without_a_subscription_every_check_reads_redis(job_id, monkeypatch):
    """Redis refusing the subscription (or it not confirmed yet) costs the round trip per step the card paid
    before the announcements, never a missed flag."""
    monkeypatch.setattr(
        flags._Subscription,
        "subscribe",
        lambda self, *channels: (_ for _ in ()).throw(flags.redis.ConnectionError("refused")),
    )
    watch = flags.FlagWatch(recheck_seconds=LONG)
    assert watch.subscribe(timeout=0.1) is False
    watch.track(job_id)
    assert [watch.current(job_id) for _ in range(3)] == [(None, None)] * 3 and watch.reads == 3
    redis_client().set(CANCEL_KEY.format(job_id=job_id), "1", ex=60)
    assert watch.current(job_id) == (b"1", None)


def test_a_forked_child_starts_without_its_parents_watch():
    """A prefork pool's child (or the zygote's) must not read its parent's subscription socket."""
    parent = flags.watch()
    pid = os.fork()
    if pid == 0:  # the child: exit at once, without pytest's teardown
        os._exit(0 if flags.watch() is not parent else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert flags.watch() is parent  # the parent keeps its own
