"""Recovery: failed attempts, the reaper, and the admin's retry (re-prioritising is in `priority`)."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from genserver import deployment, metrics
from genserver.jobs import broker, segment_service
from genserver.jobs.models import ACTIVE, Job, JobStage, JobStatus
from genserver.scheduling.pools import ALL_QUEUES, WEBHOOKS
from genserver.storage import default_storage

from . import fairness, observe
from ._common import JobId, Outcome, after_end, announce_on_commit, disk_full, end_if_cancelled

log = logging.getLogger(__name__)


def fail_attempt(job_id: JobId, worker: str | None, error: str) -> Outcome:
    """A run of the job failed (an exception, or its worker died). Retry from the checkpoint or give up.

    `worker` None means the reaper, acting on an expired lease. Returns the outcome:
    "retried", "failed", or "ignored" (someone else already moved the job on).
    """
    now = timezone.now()
    held = Q(lease_owner=worker) if worker else Q(lease_expires_at__lt=now) & ~Q(lease_owner="")
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(held, pk=job_id, status__in=ACTIVE).first()
        if job is None:
            return Outcome.IGNORED
        job.attempts += 1
        job.error = error[-4000:]
        job.lease_owner, job.lease_expires_at = "", None
        if end_if_cancelled(job):
            return Outcome.CANCELLED
        full = disk_full(error)
        if full:  # retrying cannot help until someone frees space: fail now, with the reason first
            observe.transition(job.pk, job.status, JobStatus.FAILED, worker=worker or "")
            job.status, job.stage, job.finished_at = JobStatus.FAILED, JobStage.FAILED, now
            job.error = (
                f"storage full: {full} The job failed at once (not retried); free space and retry it "
                f"from the admin.\n\n{job.error}"
            )[:4000]
            job.save()
            transaction.on_commit(lambda: after_end(job.pk))
            return Outcome.FAILED
        if job.attempts >= settings.MAX_ATTEMPTS:
            observe.transition(job.pk, job.status, JobStatus.FAILED, worker=worker or "")
            job.status, job.stage, job.finished_at = JobStatus.FAILED, JobStage.FAILED, now
            job.error = f"gave up after {job.attempts} attempts; last error: {job.error}"
            job.save()
            transaction.on_commit(lambda: after_end(job.pk))
            return Outcome.FAILED
        job.stage = JobStage.RETRYING
        job.published_at = now
        job.save()
        transaction.on_commit(lambda: republish(job))
        announce_on_commit(job.pk, "retrying")  # `error` and `attempts` changed
        return Outcome.RETRIED


def republish(job: Job) -> None:
    """Publish the task that continues `job` from where the database says it is."""
    if job.status in (JobStatus.QUEUED, JobStatus.ENCODING):
        broker.send_encode(job.id, job.priority)
    elif job.status == JobStatus.DENOISING:
        broker.send_chunk(job.id, job.checkpoint_step, job.queue, job.priority, job.model)
    elif job.status == JobStatus.DECODING and job.segment_count > 1:
        segment_service.republish_decodes(job)  # the missing segment decodes, or the assembly
    elif job.status == JobStatus.DECODING:
        broker.send_decode(job.id, job.priority, job.model)


def reap_stale() -> dict[str, int]:
    """Beat task body: recover jobs whose worker died or whose message was lost.

    1. A job whose lease expired lost its worker mid-stage: a failed attempt,
       retried from its checkpoint (or failed after MAX_ATTEMPTS).
    2. A job nobody holds, whose message is no longer waiting in the broker
       and was published more than a lease ago, lost its message (a worker
       died between taking it and claiming the job, or between committing a
       chunk and publishing the next; or Redis lost its data). It is
       re-published from the database; a duplicate would be harmless. A job
       the fair window holds has no message by design and is not one.
    3. Held jobs whose owner's fair window has room are released (a worker
       that died between a claim and its release would otherwise strand them).
    """
    now = timezone.now()
    stale = list(
        Job.objects.filter(status__in=ACTIVE, lease_expires_at__lt=now)
        .exclude(lease_owner="")
        .values_list("pk", "lease_owner")
    )
    outcomes: dict[str, int] = {}
    for pk, owner in stale:
        outcome = fail_attempt(pk, None, f"worker {owner} stopped renewing its lease (lost or killed)")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome != Outcome.IGNORED:
            metrics.REAPER_ACTIONS.labels("failed_attempt").inc()
            log.warning("reaper: job %s held by %s → %s", pk, owner, outcome)
    quiet_since = now - timedelta(seconds=settings.LEASE_SECONDS)
    orphans = list(Job.objects.filter(status__in=ACTIVE, lease_owner="", held=False, published_at__lt=quiet_since))
    if orphans:
        # A waiting webhook delivery names the job too, but does not move it on.
        waiting = broker.broker_job_ids((set(ALL_QUEUES) | deployment.layout().all_queues()) - {WEBHOOKS})
        for job in orphans:
            if str(job.pk) in waiting:
                continue
            if Job.objects.filter(pk=job.pk, lease_owner="", published_at=job.published_at).update(published_at=now):
                log.warning("reaper: job %s had no message in the broker; re-published", job.pk)
                republish(job)
                metrics.REAPER_ACTIONS.labels("republished").inc()
                outcomes[Outcome.REPUBLISHED] = outcomes.get(Outcome.REPUBLISHED, 0) + 1
    released = fairness.release_all_with_room()  # a crash between a claim and its release strands nothing
    if released:
        outcomes["released"] = released
    for segment_outcome, n in segment_service.reap_segments(now).items():
        outcomes[f"segments {segment_outcome}"] = n
    return outcomes


def retry_failed(job: Job) -> bool:
    """Admin action: give a failed job a fresh set of attempts, continuing from the checkpoint it kept
    (a failed job keeps its latest until retention removes it; a long video restarts at its first
    segment not yet published)."""
    if job.status != JobStatus.FAILED:
        return False
    has_checkpoint = bool(job.checkpoint_key) and default_storage().exists(job.checkpoint_key)
    status = (
        JobStatus.QUEUED
        if not job.embeddings_key
        else (JobStatus.DECODING if has_checkpoint and job.checkpoint_step >= job.total_steps else JobStatus.DENOISING)
    )
    fields = dict(
        status=status,
        stage=JobStage.RETRYING,
        attempts=0,
        error="",
        finished_at=None,
        published_at=timezone.now(),
        start_deadline=None,  # staff asked for this run: a start deadline from the submit no longer applies
    )
    if has_checkpoint:
        fields.update(steps_done=job.checkpoint_step)  # the steps after it are done again
    else:
        fields.update(checkpoint_step=0, checkpoint_key="", steps_done=0)
        if status == JobStatus.DECODING:
            fields["status"] = JobStatus.DENOISING
    if job.segment_count > 1 and job.embeddings_key:
        fields.update(segment_service.retry_fields(job, has_checkpoint))  # from the first segment not published
    # The checkpoint it found must still be the row's: retention may have just forgotten it.
    if not Job.objects.filter(pk=job.pk, status=JobStatus.FAILED, checkpoint_key=job.checkpoint_key).update(**fields):
        return False
    observe.transition(job.pk, JobStatus.FAILED, str(fields["status"]))
    job.refresh_from_db()
    republish(job)
    return True
