"""Fair share through the whole stack (real workers, one card): a burst does not put another user's job behind it.

card0, the only card, stops consuming (tests/test_stack_merging.py's `card_paused`) while alice submits
a burst and bob one job; when it takes work again, bob's job starts first: it is published one priority
step ahead of alice's one message that the window let through (bob is the lighter user), and her burst's
other jobs are held. With the window off, first-come.
The window is set in this process, where submits hold jobs; the suite's workers run with it off
(tests/settings.py), so a release publishes all of her held jobs at once, behind bob's: the order
asserted is the submit side's, and tests/jobs/test_fairness.py checks the releases one by one.
A job placed ahead also cuts another user's running chunk: alice's video, planned as one chunk, is cut at a
step for bob's image (and runs to its planned end with the window off).
The assertions are on the order the jobs started and the chunks they ran, never on how long anything took.
"""

from __future__ import annotations

import pytest

from genserver.jobs.broker import broker_job_ids
from genserver.jobs.models import Job
from tests.support.api import submit
from tests.support.waits import finished, job_row, wait_for
from tests.test_stack_merging import card_paused

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]

BURST = 8
SHORT_QUEUE = "short"  # where the burst's 1024² images wait for the card
# 1024², 30 steps: about 1.6 s of card time, priority 1 of the short band, so that bob's job can go one step ahead
# (a sub-second draft is at the band's first priority already, and waits behind the one published job).
SHAPE = {"model": "sdxl-sim", "steps": 30, "width": 1024, "height": 1024}


def _burst_then_one(stack, alice, bob) -> tuple[list[str], str]:
    with card_paused(stack):
        mine = [submit(alice, prompt=f"burst {i}", **SHAPE).json()["id"] for i in range(BURST)]
        theirs = submit(bob, prompt="one of bob's", **SHAPE).json()["id"]
        # Every published job is encoded and its chunk message is in the broker (held ones have no message
        # yet): the row says `waiting` just before the encode worker's commit publishes the chunk, and a card
        # let go between the two would take whatever had arrived.
        wait_for(
            lambda: _published_and_waiting([*mine, theirs]),
            60,
            what="the published jobs encoded and their chunks waiting in the broker",
        )
    jobs = [finished(pk, timeout=120) for pk in [*mine, theirs]]
    assert all(j.status == "succeeded" for j in jobs), [j.error for j in jobs]
    return mine, theirs


def _published_and_waiting(job_ids: list[str]) -> bool:
    published = list(Job.objects.filter(pk__in=job_ids, held=False))
    if not all(j.stage == "waiting" for j in published):
        return False
    return {str(j.pk) for j in published} <= broker_job_ids([SHORT_QUEUE])


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


# 2,960 s of work: 6 s on the test clock, one chunk when CHUNK_SECONDS is long.
VIDEO = {"model": "wan-sim", "width": 1280, "height": 720, "num_frames": 81}


def _video_then_images(alice, bob, settings) -> tuple[Job, Job]:
    """Alice's video runs on the card as one planned chunk; then she submits two images and bob one."""
    settings.CHUNK_SECONDS = 5000.0  # of work, in this process, where submit plans chunks: the video is one
    video = submit(alice, prompt="alice's video", **VIDEO).json()["id"]
    wait_for(lambda: job_row(video).started_at, 60, what="alice's video to start on the card")
    mine = [submit(alice, prompt=f"alice's image {i}", **SHAPE).json()["id"] for i in range(2)]
    theirs = submit(bob, prompt="bob's image", **SHAPE).json()["id"]
    jobs = [finished(pk, timeout=120) for pk in [video, *mine, theirs]]
    assert all(j.status == "succeeded" for j in jobs), [j.error for j in jobs]
    return job_row(video), job_row(theirs)


def test_a_job_placed_ahead_cuts_another_users_running_chunk(stack, make_user, settings):
    settings.FAIR_WINDOW = 1
    video, theirs = _video_then_images(make_user("alice"), make_user("bob"), settings)
    assert video.chunk_steps == video.steps  # planned as one chunk
    assert video.chunks_run >= 2  # cut at a step for bob's image, then resumed from its checkpoint
    assert theirs.started_at < video.finished_at


def test_with_the_window_off_nobody_is_placed_ahead_and_the_chunk_runs_to_its_end(stack, make_user, settings):
    settings.FAIR_WINDOW = 0
    video, _ = _video_then_images(make_user("alice"), make_user("bob"), settings)
    assert video.chunk_steps == video.steps and video.chunks_run == 1
