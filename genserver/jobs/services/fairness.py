"""Fair share between users inside a class: hold a burst's jobs at submit, publish them as the user's jobs start.

The policy (window size, when a job is held, which held job goes next) is
`genserver.scheduling.fairness`, the same the simulator runs; this module
applies it to the rows. The lightest user's new job is recorded and published
one priority step ahead (`place_new_job`). A user's *window* in a denoise queue is their jobs
there that are active, not held, and whose first chunk no card has claimed
yet (`chunks_run` 0): published, not started. A held job is `queued` with
`held` set and no message (`published_at` empty, so the reaper does not
re-publish it). `release_held` publishes the user's best held jobs while their
window has room: one compare-and-set `held` True → False each, then the same
publish as submit (encode, or the first chunk when the prompt's embeddings are
stored). It runs when a job's first chunk is claimed (`transitions.claim_chunk`),
when a job ends (`_common.after_end`: cancelled, expired, failed or done), and
from the reaper (`recovery.reap_stale`: a crash between a claim and its release
strands nothing). Submits of one user are serialised by the owner-row lock that
the quota check takes (`quotas.check_limits`), so the window is not overshot
by concurrent submits; two releases racing can overshoot it by one at most
(each counts, then flips its own row), which only costs a little fairness.

A leaf like `_common` (it imports no other part of the service but the leaf `embeddings`), so that
`_common.after_end` can call it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from genserver import deployment
from genserver.jobs import broker, events, selectors
from genserver.jobs.models import ACTIVE, Job, JobStage, JobStatus
from genserver.registry import RegistryError
from genserver.scheduling.fairness import FairWindow, ahead_priority, release_key

from .embeddings import first_stage

log = logging.getLogger(__name__)


def window() -> FairWindow:
    """The fair window as configured (GENSERVER_FAIR_WINDOW; 0: off)."""
    return FairWindow(settings.FAIR_WINDOW)


def in_window(owner_id: Any, queue: str) -> int:
    """How many of the user's jobs of the queue are published and not yet started."""
    return selectors.published_unstarted(owner_id, queue)


@dataclass(frozen=True)
class Placement:
    """Where a new job goes: held or published, at which priority, and what the window read to decide (None
    with the window off), which the submit's answer reuses (QueueSnapshot.with_new_job)."""

    held: bool
    priority: int
    picture: selectors.FairPicture | None = None


def place_new_job(owner_id: Any, queue: str, priority: int, duration_class: str) -> Placement:
    """Inside submit's transaction (after the owner's row is locked): whether the new job is held, and the
    priority it is recorded and published at. The lightest user's job goes one step ahead of its own
    priority (scheduling.fairness.ahead_priority), so that it is taken before the heavier users' messages
    at its priority rather than behind them."""
    policy = window()
    if not policy.enabled:
        return Placement(False, priority)
    picture = selectors.fair_picture(queue)
    waiting = picture.unstarted()  # published and not started, and held
    mine = waiting.get(owner_id, 0)
    others = [n for owner, n in waiting.items() if owner != owner_id]
    if mine:  # their published, unstarted jobs: counted by the picture's read unless it stopped short
        published_mine = picture.published.get(owner_id, 0) if picture.complete else in_window(owner_id, queue)
    else:
        published_mine = 0
    if policy.holds(published_mine, mine, others):
        return Placement(True, priority, picture)
    if policy.goes_ahead(mine, others):
        return Placement(False, ahead_priority(priority, duration_class), picture)
    return Placement(False, priority, picture)


def mark_ahead(job_id: Any) -> None:
    """After submit commits a job placed ahead: until its first chunk is claimed, a card running another user's
    chunk cuts it at its next step for this job's message (one card per message; tasks/denoise.py). A broker
    that is down only loses the cut: the job still waits ahead in the broker's order."""
    try:
        broker.mark_ahead(job_id)
    except Exception:  # an optimisation of its start, never a reason to fail the submit
        log.warning("could not mark job %s ahead; it waits for the next chunk end", job_id, exc_info=True)


def clear_ahead(job_id: Any) -> None:
    """Its first chunk was claimed: it cuts nobody's chunk any more (a mark left behind expires)."""
    try:
        broker.clear_ahead(job_id)
    except Exception:  # the mark expires; a stale one matches no waiting message
        log.warning("could not clear job %s's ahead mark; it expires", job_id, exc_info=True)


def publish_new(job_id: Any, status: str, queue: str, priority: int, model: str = "") -> None:
    """A new (or just released) job's first message: encode, or its first chunk when its embeddings are stored.
    A broker that is down leaves it to the reaper (its `published_at` is set)."""
    try:
        if status == JobStatus.DENOISING:
            broker.send_chunk(job_id, 0, queue, priority, model)
        else:
            broker.send_encode(job_id, priority, queue)
    except Exception:  # noqa: BLE001 - the row says published: the reaper re-publishes a missing message
        log.warning("broker unavailable: released job %s is recorded and the reaper will publish it", job_id)


def release_held(owner_id: Any, queue: str) -> int:
    """Publish the user's best held jobs of the queue (lowest priority number, then oldest) while their window
    has room. Returns how many it released. Safe to call at any time and from anywhere: with the window off,
    every held job is released."""
    policy = window()
    released = 0
    while True:
        # The held ones first (over job_held, almost always none): a first claim costs one small read then.
        candidates = list(
            Job.objects.filter(owner_id=owner_id, queue=queue, held=True, status__in=ACTIVE, cancel_requested=False)
            .order_by("priority", "created_at")
            .values_list("pk", "priority", "created_at")[:8]
        )
        if not candidates or policy.room(in_window(owner_id, queue)) <= 0:
            return released
        pk = min(candidates, key=lambda c: release_key(c[1], c[2]))[0]
        if _release_one(pk):
            released += 1


def _release_one(pk: Any) -> bool:
    """One compare-and-set held → published, then the publish once it commits. False when another release
    (or a cancel) took the row first."""
    job = Job.objects.filter(pk=pk, held=True, status__in=ACTIVE).first()
    if job is None:
        return False
    fields: dict[str, Any] = {"held": False, "published_at": timezone.now()}
    embeddings = _first_chunk_embeddings(job) if job.status == JobStatus.QUEUED else ""
    if embeddings:  # as submit does on an embedding hit (or for a model that encodes on its card)
        fields.update(status=JobStatus.DENOISING, stage=JobStage.WAITING, embeddings_key=embeddings)
    with transaction.atomic():
        if not Job.objects.filter(pk=pk, held=True, status=job.status).update(**fields):
            return False
        status = fields.get("status", job.status)
        transaction.on_commit(lambda: publish_new(pk, status, job.queue, job.priority, job.model))
        events.publish_on_commit(pk, "released")  # its position and ETA changed
    return True


def _first_chunk_embeddings(job: Job) -> str:
    """The key its first chunk denoises from when it skips the encode worker, else "" (services/embeddings.py)."""
    try:
        spec = deployment.registry().get(job.model)
    except RegistryError:
        return ""
    return first_stage(spec, job.prompt, job.negative_prompt).embeddings_key


def release_all_with_room() -> int:
    """The reaper's pass: every (user, queue) with held jobs releases what its window has room for."""
    pairs = {(r.owner_id, r.queue) for r in selectors.held_rows()}  # the held tally's rows
    return sum(release_held(owner_id, queue) for owner_id, queue in pairs)
