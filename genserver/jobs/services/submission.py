"""Submission (API side): quotas, admission, idempotent retries, and cancel."""

from __future__ import annotations

import hashlib
import json
import logging
from functools import partial
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from genserver import deployment, metrics
from genserver.jobs import broker, flags, rows, selectors
from genserver.jobs.models import ACTIVE, DEFAULT_WEBHOOK_EVENTS, Job, JobStage, JobStatus
from genserver.scheduling.admission import Decision, decide

from . import fairness, observe
from ._common import after_end, announce_on_commit, insert_job, publish_or_leave_to_reaper
from .deadlines import StartDeadlineRefused, deadline_from
from .embeddings import first_stage
from .estimates import Estimate, chunked_for_queue, estimate
from .quotas import NotAllowed, QuotaExceeded, charge_of, check_allowed, check_limits

log = logging.getLogger(__name__)


class AdmissionRefused(Exception):
    """The job's class is over its expected-wait limit (→ 429 with Retry-After); nothing was recorded."""

    def __init__(self, decision: Decision, duration_class: str) -> None:
        super().__init__(decision.reason)
        self.decision = decision
        self.duration_class = duration_class


# The metric's refusal reasons (docs/METRICS.md) for the API's quota codes.
_METRIC_REASON = {
    "too_many_in_flight": "in_flight",
    "rate_limited": "rate_limited",
    "card_seconds_per_day": "card_seconds",
}


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before for a different request (→ 422)."""


def fingerprint(data: dict[str, Any]) -> str:
    """A stable digest of a validated request (the seed included once it is drawn)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def replayed_job(owner: Any, idempotency_key: str, data: dict[str, Any]) -> Job | None:
    """The job an earlier submit with this key created, or None. Raises IdempotencyConflict when
    the key came with a different request. A request without a seed matches on everything else."""
    if not idempotency_key:
        return None
    job = Job.objects.filter(owner=owner, idempotency_key=idempotency_key).first()
    if job is None:
        return None
    candidate = {k: v for k, v in data.items() if k != "seed_drawn"}
    if data.get("seed_drawn"):
        candidate["seed"] = job.seed  # the retry drew its own seed; the first one's counts
    if job.request_fingerprint != fingerprint(candidate):
        raise IdempotencyConflict(
            f"Idempotency-Key {idempotency_key!r} was used for a different request "
            f"(job {job.pk}); use a new key for a new request."
        )
    return job


def submit_job(owner: Any, data: dict[str, Any], idempotency_key: str = "") -> Job:
    """Admit and record a validated request (`submit`, without the queue's picture it answers with)."""
    return submit(owner, data, idempotency_key)[0]


def submit(owner: Any, data: dict[str, Any], idempotency_key: str = "") -> tuple[Job, selectors.QueueSnapshot]:
    """Admit and record a validated request, then publish its encode task, or, when the prompt's
    embeddings are already stored (a retry, a re-run, the same prompt at another seed or size) or the
    model encodes on its card (`encode_on_card`), its first denoise chunk: the job is recorded
    `denoising`/`waiting` with its embeddings' key, as the encode stage would have left it, and the
    encode worker never sees it (services/embeddings.py).

    Writes nothing and raises NotAllowed (→ 403) when the owner's quota does not allow the model
    or lane (services/quotas.py), AdmissionRefused (→ 429) when the class is over its limit,
    StartDeadlineRefused (→ 429 with the quote) when `start_within` is given and the expected
    start is later, and QuotaExceeded (→ 429; InFlightLimitReached for unfinished jobs) when the
    owner's quota is used up; an IntegrityError when another submit recorded the same
    `idempotency_key` first.
    """
    spec = deployment.registry().get(data["model"])
    est = estimate(data)
    quota = selectors.effective_quota(owner)
    charge = charge_of(est.seconds, est.clock_scale)
    try:
        check_allowed(quota, spec.name, data.get("lane", ""), charge)
    except NotAllowed:
        metrics.count_submit(est.duration_class, "not_allowed")
        raise
    queue = deployment.layout().queue_for(est.duration_class, spec.name, data.get("lane", ""))
    est = chunked_for_queue(est, queue, data["steps"])
    # The queue's picture, read once: admission decides on it, and the answer's position and ETA count the
    # new job into it (QueueSnapshot.with_new_job) instead of reading it again.
    snapshot = selectors.QueueSnapshot.load()
    capacity = snapshot.layout  # the cards alive now, on every node
    wind = selectors.headwind_for(est.duration_class, queue, capacity)  # better classes will preempt it
    decision = decide(queue, est.priority, snapshot.backlog_items(), capacity, deployment.limits(), wind)
    if not decision.accepted:
        metrics.count_submit(est.duration_class, "wait_limit")
        raise AdmissionRefused(decision, est.duration_class)
    start_within = data.get("start_within")
    if start_within and not decision.expected_wait_seconds <= start_within:  # inf: no live card serves it
        metrics.count_submit(est.duration_class, "start_deadline")
        own = est.seconds * est.clock_scale / capacity.job_speedup(queue)  # as QueueSnapshot's ETA
        raise StartDeadlineRefused(start_within, decision.expected_wait_seconds, own)
    recorded = {k: v for k, v in data.items() if k != "seed_drawn"}
    first = first_stage(spec, data["prompt"], data.get("negative_prompt", ""))
    # The row is built before the owner's row is locked (what the lock holds up is the user's next submit);
    # its placement fills in the rest.
    job = _new_job(owner, spec, data, est, queue, idempotency_key, fingerprint(recorded), charge)
    with transaction.atomic():
        try:
            check_limits(owner, quota, charge)
        except QuotaExceeded as refused:
            metrics.count_submit(est.duration_class, _METRIC_REASON[refused.reason])
            raise
        # The owner's row is locked (check_limits): the user's submits count their window one at a time.
        placement = fairness.place_new_job(owner.pk, queue, est.priority, est.duration_class)
        held = placement.held
        ahead = placement.priority < est.priority
        # A held job's embeddings are looked up again when it is released (they may be stored by then).
        embeddings = "" if held else first.embeddings_key
        _record_job(job, held, placement.priority, embeddings)
        # Once the row commits, in this order: the cut mark (before a card can claim the job and clear it), the
        # message (the job's dispatch waits for it), then what nobody waits for: the metrics and the log line.
        if ahead:
            transaction.on_commit(lambda: fairness.mark_ahead(job.id))
        if held:
            pass  # published by fairness.release_held when one of the owner's jobs in the queue starts or ends
        elif embeddings:
            transaction.on_commit(
                lambda: publish_or_leave_to_reaper(
                    partial(broker.send_chunk, row=rows.row_of(job)), job.id, 0, job.queue, job.priority, job.model
                )
            )
            if first.stored:  # counted where it is looked up: here, by the encode worker, or by the card
                transaction.on_commit(lambda: metrics.count_embedding_cache(1, 0))
        else:
            transaction.on_commit(
                lambda: publish_or_leave_to_reaper(broker.send_encode, job.id, job.priority, job.queue)
            )
        transaction.on_commit(lambda: metrics.count_submit(job.duration_class))
        observe.recorded(job)
    return job, snapshot.with_new_job(job, placement.picture, wind)


def submit_or_replay(
    owner: Any, data: dict[str, Any], idempotency_key: str = ""
) -> tuple[Job, bool, selectors.QueueSnapshot | None]:
    """(the job, whether it is a replay, the queue's picture with a new job in it: None for a replay): a
    submit that a client may safely retry with the same key."""
    replay = replayed_job(owner, idempotency_key, data)
    if replay is not None:
        return replay, True, None
    try:
        job, snapshot = submit(owner, data, idempotency_key)
    except IntegrityError:
        replay = replayed_job(owner, idempotency_key, data)  # a concurrent retry committed first
        if replay is None:
            raise
        return replay, True, None
    return job, False, snapshot


def _new_job(
    owner: Any,
    spec: Any,
    data: dict[str, Any],
    est: Estimate,
    queue: str,
    idempotency_key: str,
    request_fingerprint: str,
    charge: float,
) -> Job:
    """The job's row as the request and its estimate make it, before its placement (`_record_job`)."""
    return Job(
        owner=owner,
        model=spec.name,
        family=spec.family,
        kind=spec.kind,
        backend=spec.backend,
        prompt=data["prompt"],
        negative_prompt=data.get("negative_prompt", ""),
        width=data["width"],
        height=data["height"],
        num_frames=data["num_frames"],
        steps=data["steps"],
        guidance_scale=data["guidance_scale"],
        seed=data["seed"],
        num_outputs=data["num_outputs"],
        preview_every=data.get("preview_every", 0),
        webhook_url=data.get("webhook_url", ""),
        webhook_events=list(data.get("webhook_events", DEFAULT_WEBHOOK_EVENTS)),
        estimated_seconds=est.seconds,
        clock_scale=est.clock_scale,
        duration_class=est.duration_class,
        queue=queue,
        priority=est.priority,
        chunk_steps=est.chunk_steps,
        segment_frames=est.segment_frames,
        segment_count=est.segment_count,
        idempotency_key=idempotency_key,
        request_fingerprint=request_fingerprint,
        start_deadline=deadline_from(data.get("start_within")),
        charged_card_seconds=charge,  # the day's quota counts the estimate until the job ends (quotas.settle)
    )


def _record_job(job: Job, held: bool, priority: int, embeddings_key: str) -> None:
    """Insert the job's row, placed: `queued` for encode, or `denoising`/`waiting` for its first chunk when its
    embeddings are stored (`embeddings_key`); `held` by its owner's fair window: `queued`, unpublished; at the
    priority its placement gave it."""
    hit = bool(embeddings_key)
    job.held, job.priority, job.embeddings_key = held, priority, embeddings_key
    job.status = JobStatus.DENOISING if hit else JobStatus.QUEUED
    job.stage = JobStage.WAITING if hit else JobStage.QUEUED
    job.published_at = None if held else timezone.now()
    insert_job(job)


def cancel_job(job: Job) -> Job:
    """Ask a job to stop. Idempotent; a finished job stays as it is.

    A job no worker holds ends `cancelled` at once (its queued message finds it
    terminal and does nothing); a running one sees the flag before its next
    step and ends itself, skipping decode.
    """
    if job.is_terminal:
        return job
    try:
        flags.raise_cancel(job.id)
    except Exception:  # noqa: BLE001 - the DB flag is the truth; workers also check it per chunk
        log.warning("could not mirror the cancel flag of job %s in Redis", job.id)
    now = timezone.now()
    Job.objects.filter(pk=job.pk, status__in=ACTIVE).update(cancel_requested=True)
    unheld = Q(lease_owner="") | Q(lease_expires_at__lt=now)
    ended = Job.objects.filter(unheld, pk=job.pk, status__in=ACTIVE).update(
        status=JobStatus.CANCELLED,
        stage=JobStage.CANCELLED,
        finished_at=now,
        lease_owner="",
        lease_expires_at=None,
        held=False,  # a held job ends without ever being published
    )
    if ended:
        observe.transition(job.pk, job.status, JobStatus.CANCELLED)
        after_end(job.pk)
    else:
        announce_on_commit(job.pk, "cancelling")  # a worker holds it: it stops within a step
    job.refresh_from_db()
    return job
