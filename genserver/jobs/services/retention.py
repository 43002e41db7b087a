"""Retention: expire old outputs, failed jobs' kept checkpoints, unused embeddings and old job rows (with their files).

Checkpoints go when a job ends, except a failed job's latest (the admin's retry resumes there),
which goes FAILED_CHECKPOINT_TTL_SECONDS after the failure. A job row deleted by the purge
(JOB_TTL_SECONDS) or in the admin takes its files with it (`job_deleted`, a post_delete handler).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from genserver.jobs.models import ACTIVE, TERMINAL, Job, JobSegment, JobStage, JobStatus
from genserver.storage import StorageError, default_storage

from ._common import delete_job_files, drop_checkpoints

EMBEDDINGS = "embeddings"
ASIDE = ".deleting-"  # a candidate moved aside while the database is asked again

log = logging.getLogger(__name__)


def retain(now: datetime | None = None) -> dict[str, int]:
    """Beat task body: expire old outputs and failed jobs' checkpoints, drop unused embeddings, purge old rows."""
    now = now or timezone.now()
    return {
        "outputs_expired": expire_outputs(now),
        "checkpoints_expired": expire_failed_checkpoints(now),
        "embeddings_deleted": sweep_embeddings(now),
        "jobs_purged": purge_jobs(now),
    }


def expire_failed_checkpoints(now: datetime | None = None, batch: int = 500) -> int:
    """Delete the checkpoint a failed job kept for a retry, FAILED_CHECKPOINT_TTL_SECONDS after it failed.

    The row forgets it first (a retry from then on starts over), then the files go; a job retried
    meanwhile is no longer failed and keeps its checkpoint.
    """
    ttl = settings.FAILED_CHECKPOINT_TTL_SECONDS
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=ttl)
    candidates = (
        Job.objects.filter(status=JobStatus.FAILED, finished_at__lt=cutoff)
        .exclude(checkpoint_key="")
        .order_by("finished_at")
        .values_list("pk", "checkpoint_key")[:batch]
    )
    expired = 0
    for pk, key in candidates:
        forgot = Job.objects.filter(pk=pk, status=JobStatus.FAILED, checkpoint_key=key).update(
            checkpoint_key="", checkpoint_step=0, steps_done=0
        )
        if forgot:
            drop_checkpoints(pk)
            expired += 1
    return expired


def purge_jobs(now: datetime | None = None, batch: int = 500) -> int:
    """Delete the rows of jobs that ended more than JOB_TTL_SECONDS ago (0: never), and so their files.

    The files go with each row (`job_deleted`), once the deletion committed.
    """
    ttl = settings.JOB_TTL_SECONDS
    if ttl <= 0:
        return 0
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=ttl)
    old = Job.objects.filter(status__in=TERMINAL, finished_at__lt=cutoff).order_by("finished_at")
    ids = list(old.values_list("pk", flat=True)[:batch])
    if not ids:
        return 0
    with transaction.atomic():
        deleted = Job.objects.filter(pk__in=ids, status__in=TERMINAL).delete()[1].get(Job._meta.label, 0)
    return deleted


def job_deleted(sender: type, instance: Job, **kwargs: Any) -> None:
    """post_delete of Job (the purge, the admin's delete, a user's deletion): its files go once the
    deletion commits, so an aborted delete keeps them."""
    pk = instance.pk
    transaction.on_commit(lambda: _delete_files_quietly(pk))


def _delete_files_quietly(pk: Any) -> None:
    try:
        delete_job_files(pk)
    except Exception:  # the row is gone either way; a later sweep cannot find these files
        log.warning("retention: could not delete the files of deleted job %s", pk, exc_info=True)


def expire_outputs(now: datetime | None = None, batch: int = 500) -> int:
    """Delete outputs and previews of jobs that ended more than OUTPUT_TTL_SECONDS ago.

    The job row stays (its history, its error); a succeeded one shows stage
    "expired" and no outputs, and its old output URLs answer 404.
    """
    ttl = settings.OUTPUT_TTL_SECONDS
    if ttl <= 0:
        return 0
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=ttl)
    storage = default_storage()
    expired = 0
    has_segments = Exists(JobSegment.objects.filter(job=OuterRef("pk")))  # a long video's published clips
    candidates = (
        Job.objects.filter(
            ~Q(outputs=[]) | ~Q(preview_key="") | has_segments, status__in=TERMINAL, finished_at__lt=cutoff
        )
        .order_by("finished_at")
        .values_list("pk", "status")[:batch]
    )
    for pk, status in candidates:
        storage.delete_prefix(f"outputs/{pk}")
        storage.delete_prefix(f"previews/{pk}")
        fields: dict[str, Any] = {"outputs": [], "preview_key": ""}
        if status == JobStatus.SUCCEEDED:
            fields["stage"] = JobStage.EXPIRED
        expired += Job.objects.filter(pk=pk, status__in=TERMINAL).update(**fields)
        JobSegment.objects.filter(job_id=pk).delete()
    return expired


def sweep_embeddings(now: datetime | None = None) -> int:
    """Delete cached prompt embeddings that no active job uses and none has used for EMBEDDINGS_TTL_SECONDS.

    Works on either storage backend through its methods:
    1. Put back the candidates a sweep that died midway left aside, and decide again.
    2. Touch what an active job references (modified = last seen in use; on S3 the store's clock).
    3. Move each old unused one aside, then ask the database again: if an active job now references
       one, or any job is encoding (it may have just found the object in the cache), put them back.
    """
    now = now or timezone.now()
    storage = default_storage()

    def in_use() -> set[str]:
        return set(
            Job.objects.filter(status__in=ACTIVE).exclude(embeddings_key="").values_list("embeddings_key", flat=True)
        )

    entries = list(storage.list(EMBEDDINGS))
    names = {entry.key for entry in entries}
    for entry in entries:  # 1. left by a sweep that died midway
        folder, _, name = entry.key.rpartition("/")
        if name.startswith(ASIDE):
            original = f"{folder}/{name[len(ASIDE) :]}"
            try:
                if original in names:
                    storage.delete(entry.key)
                else:
                    storage.move(entry.key, original)
            except StorageError:
                pass
    used = in_use()
    stamp = now.timestamp()
    for key in used:  # 2.
        try:
            storage.touch(key, stamp)
        except Exception:  # noqa: BLE001 - a missing object or an odd key: nothing to keep fresh
            pass
    oldest = stamp - settings.EMBEDDINGS_TTL_SECONDS
    aside: list[tuple[str, str]] = []
    for entry in entries:  # 3.
        folder, _, name = entry.key.rpartition("/")
        if name.startswith(".") or entry.key in used or entry.modified >= oldest:
            continue
        tomb = f"{folder}/{ASIDE}{name}"
        try:
            storage.move(entry.key, tomb)
        except StorageError:
            continue
        aside.append((entry.key, tomb))
    if not aside:
        return 0
    keep_all = Job.objects.filter(status=JobStatus.ENCODING).exists()
    used = in_use()
    deleted = 0
    for key, tomb in aside:
        try:
            if keep_all or key in used:
                storage.move(tomb, key)
            else:
                storage.delete(tomb)
                deleted += 1
        except StorageError:
            log.warning("retention: could not settle %s", tomb, exc_info=True)
    return deleted
