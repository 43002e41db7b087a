"""Retention: expire old outputs and previews, drop prompt embeddings no job uses (checkpoints go when a job ends)."""
from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from genserver.jobs.models import ACTIVE, TERMINAL, Job, JobSegment, JobStage, JobStatus
from genserver.storage import default_storage

log = logging.getLogger(__name__)


def retain(now: datetime | None = None) -> dict[str, int]:
    """Beat task body: expire old outputs and drop unused embeddings (checkpoints go when a job ends)."""
    now = now or timezone.now()
    return {"outputs_expired": expire_outputs(now), "embeddings_deleted": sweep_embeddings(now)}


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
    candidates = (Job.objects.filter(~Q(outputs=[]) | ~Q(preview_key="") | has_segments, status__in=TERMINAL,
                                     finished_at__lt=cutoff)
                  .order_by("finished_at").values_list("pk", "status")[:batch])
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

    Files referenced by an active job get their mtime refreshed (mtime = last
    seen in use). Candidates are renamed aside first, then the database is
    asked again: if an active job now references one, or any job is encoding
    (it may have just found the file in the cache), they are put back.
    """
    now = now or timezone.now()
    root = default_storage().path("embeddings")
    if not root.is_dir():
        return 0

    def in_use() -> set[str]:
        return set(Job.objects.filter(status__in=ACTIVE).exclude(embeddings_key="")
                   .values_list("embeddings_key", flat=True))

    for tomb in root.glob(".deleting-*"):  # left by a sweep that died midway: put back, decide again
        original = tomb.with_name(tomb.name[len(".deleting-"):])
        try:
            if original.exists():
                tomb.unlink(missing_ok=True)
            else:
                os.replace(tomb, original)
        except OSError:
            pass
    used = in_use()
    stamp = now.timestamp()
    for key in used:
        try:
            os.utime(default_storage().path(key), (stamp, stamp))
        except Exception:  # noqa: BLE001 - a missing file or an odd key: nothing to keep fresh
            pass
    oldest = stamp - settings.EMBEDDINGS_TTL_SECONDS
    aside: list[tuple[str, Path, Path]] = []
    for path in root.iterdir():
        key = f"embeddings/{path.name}"
        if not path.is_file() or path.name.startswith(".") or key in used:
            continue
        try:
            if path.stat().st_mtime >= oldest:
                continue
            tomb = path.with_name(f".deleting-{path.name}")
            os.replace(path, tomb)
        except OSError:
            continue
        aside.append((key, path, tomb))
    if not aside:
        return 0
    keep_all = Job.objects.filter(status=JobStatus.ENCODING).exists()
    used = in_use()
    deleted = 0
    for key, path, tomb in aside:
        try:
            if keep_all or key in used:
                os.replace(tomb, path)
            else:
                tomb.unlink(missing_ok=True)
                deleted += 1
        except OSError:
            log.warning("retention: could not settle %s", tomb, exc_info=True)
    return deleted
