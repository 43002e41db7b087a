"""Fair share through the whole stack (real workers, one card): a burst does not put another user's job behind it.

card0, the only card, stops consuming (tests/test_stack_merging.py's `card_paused`) while alice submits
a burst and bob one job; when it takes work again, bob's job starts first: it is published one priority
step ahead of alice's one message that the window let through (bob is the lighter user), and her burst's
other jobs are held. With the window off, first-come.
The window is set in this process, where submits hold jobs; the suite's workers run with it off
(tests/settings.py), so a release publishes all of her held jobs at once, behind bob's: the order
asserted is the submit side's, and tests/jobs/test_fairness.py checks the releases one by one.
The assertions are on the order the jobs started, never on how long anything took.
"""

from __future__ import annotations

import pytest

from genserver.jobs.models import Job
from tests.support.api import submit
from tests.support.waits import finished, job_row, wait_for
from tests.test_stack_merging import card_paused

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]

BURST = 8
# 1024², 30 steps: about 1.6 s of card time, priority 1 of the short band, so that bob's job can go one step ahead
# (a sub-second draft is at the band's first priority already, and waits behind the one published job).
SHAPE = {"model": "sdxl-sim", "steps": 30, "width": 1024, "height": 1024}


def _burst_then_one(stack, alice, bob) -> tuple[list[str], str]:
    with card_paused(stack):
        mine = [submit(alice, prompt=f"burst {i}", **SHAPE).json()["id"] for i in range(BURST)]
        theirs = submit(bob, prompt="one of bob's", **SHAPE).json()["id"]
        # Every published job is encoded and waits for the card (held ones have no message yet).
        wait_for(
            lambda: all(j.stage == "waiting" for j in Job.objects.filter(pk__in=[*mine, theirs], held=False)),
            60,
            what="the published jobs encoded and waiting for the card",
        )
    jobs = [finished(pk, timeout=120) for pk in [*mine, theirs]]
    assert all(j.status == "succeeded" for j in jobs), [j.error for j in jobs]
    return mine, theirs


def _started_before(job_id: str, others: list[str]) -> int:
    """How many of `others` started before the job (started_at: its first step, in the order the card took them)."""
    started = job_row(job_id).started_at
    return sum(1 for pk in others if job_row(pk).started_at < started)


def test_another_users_job_starts_ahead_of_a_burst(stack, make_user, settings):
    # The shipped default, where the API holds (this process). The suite's workers run first-come
    # (tests/settings.py): the first claim of alice's releases all her held jobs at once, behind bob's.
    settings.FAIR_WINDOW = 1
    alice, bob = make_user("alice"), make_user("bob")
    mine, theirs = _burst_then_one(stack, alice, bob)
    assert _started_before(theirs, mine) == 0  # ahead of the one she had published
    assert not any(Job.objects.filter(pk__in=mine).values_list("held", flat=True))  # every held job was released
    # Her burst ran in the order she submitted it (all of one priority: oldest held first).
    starts = [job_row(pk).started_at for pk in mine]
    assert starts == sorted(starts)


def test_with_the_window_off_the_order_is_first_come(stack, make_user, settings):
    settings.FAIR_WINDOW = 0  # the API (this process) holds nothing; the workers find nothing to release
    alice, bob = make_user("alice"), make_user("bob")
    mine, theirs = _burst_then_one(stack, alice, bob)
    assert _started_before(theirs, mine) == BURST
