"""The Job: one row per accepted request, the source of truth for its state.

Over 400 lines because Django keeps an app's models in one module: the Job (about 170 lines of fields, each with
what it is for, and the constraints the job service relies on), its segments, the queue and held tallies, quotas
and API tokens.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models.functions import Coalesce
from django.utils import timezone


class JobStatus(models.TextChoices):
    QUEUED = "queued"
    ENCODING = "encoding"
    DENOISING = "denoising"
    DECODING = "decoding"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its start deadline (`start_within` at submit) passed before its first step


class JobStage(models.TextChoices):
    """Finer than the status: what the job does right now (shown on the API and in the admin)."""

    QUEUED = "queued"  # accepted; its encode message waits
    ENCODING = "encoding"
    WAITING = "waiting"  # between stages or chunks: its next message waits in the broker
    DENOISING = "denoising"  # a card holds it
    DECODING = "decoding"
    RETRYING = "retrying"  # an attempt failed; it continues from its checkpoint
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # succeeded: retention deleted its outputs; status expired: its start deadline passed


# segment: a long video's clip; expired: its start deadline passed before it started
WEBHOOK_EVENTS = ("started", "preview", "segment", "succeeded", "failed", "cancelled", "expired")
DEFAULT_WEBHOOK_EVENTS = ("started", "succeeded", "failed", "cancelled", "expired")


def default_webhook_events() -> list[str]:
    return list(DEFAULT_WEBHOOK_EVENTS)


TERMINAL = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED)
ACTIVE = (JobStatus.QUEUED, JobStatus.ENCODING, JobStatus.DENOISING, JobStatus.DECODING)


class Job(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")

    # What was asked for (immutable after submit).
    model = models.CharField(max_length=100)
    family = models.CharField(max_length=20)
    kind = models.CharField(max_length=10)
    backend = models.CharField(max_length=20)
    prompt = models.TextField()
    negative_prompt = models.TextField(blank=True, default="")
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    num_frames = models.PositiveIntegerField(default=1)
    steps = models.PositiveIntegerField(
        help_text="the total: as asked, or as changed midway (a job stopped early: the steps it did)"
    )
    steps_requested = models.PositiveIntegerField(
        null=True, blank=True, help_text="the total asked at submit, once the steps were changed"
    )
    guidance_scale = models.FloatField()
    seed = models.BigIntegerField()
    num_outputs = models.PositiveSmallIntegerField(default=1)
    preview_every = models.PositiveIntegerField(default=0)
    webhook_url = models.URLField(
        max_length=500,
        blank=True,
        default="",
        help_text="receives signed JSON events (started, preview, succeeded, ...)",
    )
    # Which events the webhook receives (a subset of webhooks.EVENTS); the default: started and the end.
    webhook_events = models.JSONField(
        default=default_webhook_events,
        blank=True,
        help_text="events sent to webhook_url (default: started and terminal)",
    )

    # `start_within` at submit: a job that has not taken its first step by then ends `expired`.
    start_deadline = models.DateTimeField(
        null=True, blank=True, help_text="it must start (its first denoising step) by then, or it ends expired"
    )

    # A client's retry of the same submit (Idempotency-Key header) returns this job.
    idempotency_key = models.CharField(max_length=200, blank=True, default="")
    request_fingerprint = models.CharField(max_length=64, blank=True, default="")

    # How the scheduler sees it.
    estimated_seconds = models.FloatField(help_text="expected seconds of denoising work (cost model, corrected)")
    clock_scale = models.FloatField(default=1.0, help_text="wall seconds per second of work (simulated backend)")
    duration_class = models.CharField(max_length=10)
    queue = models.CharField(max_length=120, default="", help_text="broker queue of its denoise chunks")
    priority = models.PositiveSmallIntegerField(help_text="Redis priority of the job's next message, 0 first")
    chunk_steps = models.PositiveIntegerField(help_text="denoising steps per chunk task")
    segment_frames = models.PositiveIntegerField(default=0, help_text="frames per segment (0: not segmented)")
    segment_count = models.PositiveIntegerField(default=1, help_text="segments denoised one after the other")

    # Where it is.
    status = models.CharField(max_length=20, choices=JobStatus.choices, default=JobStatus.QUEUED, db_index=True)
    stage = models.CharField(max_length=20, choices=JobStage.choices, default=JobStage.QUEUED)
    steps_done = models.PositiveIntegerField(default=0)
    cancel_requested = models.BooleanField(default=False)
    held = models.BooleanField(
        default=False,
        help_text="held by its owner's fair window (GENSERVER_FAIR_WINDOW): recorded, not yet published",
    )
    attempts = models.PositiveIntegerField(default=0, help_text="runs lost or failed so far")
    chunks_run = models.PositiveIntegerField(default=0, help_text="denoise chunks started, redone ones included")
    error = models.TextField(blank=True, default="")

    # Recovery: who holds it, until when, and what to continue from.
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    published_at = models.DateTimeField(null=True, blank=True, help_text="when its next task was last published")
    chunk_started_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="when its current chunk began (its claim, or a boundary where its card kept it)",
    )
    embeddings_key = models.CharField(max_length=300, blank=True, default="")
    checkpoint_key = models.CharField(max_length=300, blank=True, default="")
    checkpoint_step = models.PositiveIntegerField(default=0)
    preview_key = models.CharField(max_length=300, blank=True, default="")
    preview_step = models.PositiveIntegerField(default=0)
    outputs = models.JSONField(default=list, blank=True, help_text="[{key, content_type}]")
    measured_step_seconds = models.FloatField(null=True, blank=True)
    # Quotas (genserver/jobs/services/quotas.py): card time, in wall seconds of one card.
    card_seconds = models.FloatField(
        default=0.0, help_text="measured seconds of denoising on cards (the chunks recorded; a group counts its cards)"
    )
    charged_card_seconds = models.FloatField(
        default=0.0,
        help_text="what its owner's daily card-seconds quota counts: the estimate from submit until it ends, "
        "then the measured card_seconds",
    )

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True, help_text="first denoising step")
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="unique_idempotency_key_per_owner",
            ),
            # What the job service assumes of every row (a broken row fails at the write, not in a worker).
            models.CheckConstraint(condition=models.Q(priority__gte=0, priority__lte=9), name="job_priority_0_to_9"),
            models.CheckConstraint(condition=models.Q(steps__gte=1), name="job_steps_at_least_1"),
            models.CheckConstraint(condition=models.Q(chunk_steps__gte=1), name="job_chunk_steps_at_least_1"),
            models.CheckConstraint(condition=models.Q(num_outputs__gte=1), name="job_num_outputs_at_least_1"),
            models.CheckConstraint(condition=models.Q(segment_count__gte=1), name="job_segment_count_at_least_1"),
            models.CheckConstraint(condition=models.Q(estimated_seconds__gte=0), name="job_estimate_not_negative"),
            models.CheckConstraint(condition=models.Q(clock_scale__gt=0), name="job_clock_scale_positive"),
            models.CheckConstraint(condition=models.Q(status__in=JobStatus.values), name="job_status_known"),
            models.CheckConstraint(condition=models.Q(stage__in=JobStage.values), name="job_stage_known"),
        ]
        indexes = [
            models.Index(fields=["owner", "-created_at"]),
            models.Index(fields=["status", "priority", "created_at"]),
            # The waiting jobs (active, no card holds them) in the order they wait at each priority: what
            # queue positions and ETAs count and sum (selectors.QueueSnapshot), at any queue depth.
            models.Index(
                "priority",
                Coalesce("published_at", "created_at"),
                name="job_waiting_order",
                condition=models.Q(status__in=ACTIVE)
                & ~(models.Q(status=JobStatus.DENOISING) & ~models.Q(lease_owner="")),
            ),
            # The jobs the fair window holds, per queue and owner in the order they are released
            # (services/fairness.py), and what queue positions subtract (selectors.QueueSnapshot).
            models.Index(
                fields=["queue", "owner", "priority", "created_at"],
                name="job_held",
                condition=models.Q(held=True),
            ),
            # The held jobs of each priority in the order they were submitted: a published job's place reads
            # the ones submitted after it from the newest end (selectors.QueueSnapshot._other_users_held_ahead).
            models.Index(
                fields=["priority", "created_at"],
                name="job_held_order",
                condition=models.Q(held=True, status__in=ACTIVE),
            ),
            # A user's jobs in flight, which a submit counts up to their limit (selectors.limit_counts).
            models.Index(
                fields=["owner"],
                name="job_owner_in_flight",
                condition=models.Q(status__in=ACTIVE, cancel_requested=False),
            ),
            # A user's fair window in a queue: published, not started (a few rows per user at any depth), and
            # a queue's such jobs, per user (selectors.fair_picture): the queue first, for both.
            models.Index(
                fields=["queue", "owner"],
                name="job_fair_window",
                condition=models.Q(status__in=ACTIVE, held=False, chunks_run=0),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model} {self.width}x{self.height} [{self.status}] {self.id}"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def total_steps(self) -> int:
        """Steps over all segments (`steps` per segment); `steps_done` and `checkpoint_step` count these."""
        return self.steps * max(1, self.segment_count)

    @property
    def remaining_seconds(self) -> float:
        """Expected seconds of denoising work left."""
        if self.steps <= 0:
            return 0.0
        return self.estimated_seconds * max(0, self.total_steps - self.steps_done) / self.total_steps


class SegmentStatus(models.TextChoices):
    DENOISED = "denoised"  # its last step is checkpointed; its decode is published
    DECODING = "decoding"  # a decode worker holds it
    PUBLISHED = "published"  # its clip is stored and listed on the job
    FAILED = "failed"  # its decode failed MAX_ATTEMPTS times (the job failed with it)


class JobSegment(models.Model):
    """One segment of a long video, from the end of its denoising to its published clip.

    Written only by the job service (genserver/jobs/segment_service.py) with
    compare-and-set updates; the row exists from the moment the card finished
    denoising the segment.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="segments")
    index = models.PositiveIntegerField()
    frames = models.PositiveIntegerField(help_text="frames it adds to the video")
    seed = models.BigIntegerField()
    status = models.CharField(max_length=20, choices=SegmentStatus.choices, default=SegmentStatus.DENOISED)
    checkpoint_key = models.CharField(max_length=300, blank=True, default="", help_text="its final latents")
    key = models.CharField(max_length=300, blank=True, default="", help_text="its MP4 clip")
    poster_key = models.CharField(max_length=300, blank=True, default="")
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    published_at = models.DateTimeField(null=True, blank=True, help_text="when its decode was last published")
    attempts = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    decoded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "index"]
        constraints = [
            models.UniqueConstraint(fields=["job", "index"], name="unique_segment_per_job"),
            models.CheckConstraint(condition=models.Q(status__in=SegmentStatus.values), name="segment_status_known"),
        ]
        indexes = [models.Index(fields=["status", "published_at"])]

    def __str__(self) -> str:
        return f"segment {self.index} of {self.job_id} [{self.status}]"


class QueueTally(models.Model):
    """The waiting jobs of one (queue, class, priority): how many, and their wall seconds of work left.

    Kept by database triggers on the job table (migration 0013): every write of the job service
    that moves a job into, out of or within the waiting jobs (submit, a claim, a chunk's end, a
    failed attempt, a cancel, a step change, a deletion) updates its row in the same transaction,
    so admission and the queue picture read a few rows instead of every queued job, and no write
    path can forget it. Never written by Python code. On SQLite a later migration that remakes the
    job table (most AlterFields there) drops its triggers: such a migration must install them again
    (0013's `install`); tests/jobs/test_queue_depth.py fails on SQLite if it does not.
    """

    queue = models.CharField(max_length=120)
    duration_class = models.CharField(max_length=10)
    priority = models.PositiveSmallIntegerField()
    count = models.BigIntegerField(default=0)
    seconds = models.FloatField(default=0.0, help_text="Σ remaining_seconds × clock_scale of its jobs")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["queue", "duration_class", "priority"], name="unique_queue_tally"),
        ]

    def __str__(self) -> str:
        return f"{self.queue or self.duration_class} p{self.priority}: {self.count} jobs, {self.seconds:.1f} s"


class HeldTally(models.Model):
    """The jobs the fair window holds for one user in one (queue, class, priority): how many, and their wall
    seconds of work left.

    Kept by database triggers on the job table (migration 0015), as QueueTally is, over the active
    jobs with `held` set: the fair window's reads (who holds jobs in a queue, the held jobs ahead of a
    job, a held job's round-robin share) read these few rows instead of every held job of a burst.
    Never written by Python code; the same rule for later migrations that remake the job table on
    SQLite holds for its triggers (0015's `install`).
    """

    queue = models.CharField(max_length=120)
    duration_class = models.CharField(max_length=10)
    priority = models.PositiveSmallIntegerField()
    owner_id = models.BigIntegerField(help_text="the jobs' owner (no foreign key: only triggers write the row)")
    count = models.BigIntegerField(default=0)
    seconds = models.FloatField(default=0.0, help_text="Σ remaining_seconds × clock_scale of its jobs")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["queue", "duration_class", "priority", "owner_id"], name="unique_held_tally"
            ),
        ]

    def __str__(self) -> str:
        return f"user {self.owner_id} {self.queue or self.duration_class} p{self.priority}: {self.count} held"


class Quota(models.Model):
    """Per-user or per-group limits on submits, edited in the admin (applied by services/quotas.py).

    A user's effective quota is their own row, else their groups' rows combined
    (the most generous value of each limit), else the global defaults from settings.
    A blank limit means "the global default"; 0 means "no limit".
    """

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="quota"
    )
    group = models.OneToOneField(Group, null=True, blank=True, on_delete=models.CASCADE, related_name="quota")
    max_jobs_in_flight = models.PositiveIntegerField(
        null=True, blank=True, help_text="unfinished jobs at once; blank: GENSERVER_MAX_JOBS_IN_FLIGHT; 0: no limit"
    )
    submits_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="accepted submits in any GENSERVER_SUBMIT_RATE_WINDOW seconds (60); "
        "blank: GENSERVER_SUBMIT_RATE_LIMIT; 0: no limit",
    )
    card_seconds_per_day = models.FloatField(
        null=True,
        blank=True,
        help_text="seconds of card time per UTC day (the estimate at submit, the measured time once a job ends); "
        "blank: GENSERVER_QUOTA_CARD_SECONDS_PER_DAY; 0: no limit",
    )
    allowed_models = models.JSONField(
        default=list, blank=True, help_text='model names, e.g. ["sdxl-sim"]; empty: every model'
    )
    allowed_lanes = models.JSONField(
        default=list,
        blank=True,
        help_text='lanes a job may ask for, e.g. ["interactive"]; empty: every lane '
        "(a job without a lane is always allowed)",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(user__isnull=False) & models.Q(group__isnull=True))
                | (models.Q(user__isnull=True) & models.Q(group__isnull=False)),
                name="quota_for_a_user_or_a_group",
            ),
            models.CheckConstraint(
                condition=models.Q(card_seconds_per_day__isnull=True) | models.Q(card_seconds_per_day__gte=0),
                name="quota_card_seconds_not_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"quota of user {self.user}" if self.user_id else f"quota of group {self.group}"

    def clean(self) -> None:
        from genserver import deployment

        errors: dict[str, str] = {}
        if bool(self.user_id) == bool(self.group_id):
            errors["user"] = "Choose a user or a group (one of them, not both)."
        known = set(deployment.registry().names())
        for field, valid, what in (
            ("allowed_models", known, "a model of the registry"),
            ("allowed_lanes", None, "a lane name"),
        ):
            value = getattr(self, field)
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                errors[field] = f'A JSON list of names is required, e.g. ["name"] (each {what}); [] allows all.'
            elif valid is not None and (unknown := sorted(set(value) - valid)):
                errors[field] = f"Unknown model(s) {', '.join(unknown)}; known: {', '.join(sorted(valid))}."
        if errors:
            raise ValidationError(errors)


class UserUsage(User):
    """A user as the admin's read-only usage page shows them (their counts and effective quota)."""

    class Meta:
        proxy = True
        verbose_name = "usage of a user"
        verbose_name_plural = "usage of users"


class ApiToken(models.Model):
    """An API token (`Authorization: Token <key>` or `Bearer <key>`): its owner, name, expiry and last use.

    The key itself is never stored: only its first characters (`prefix`, public, to find the row and to
    tell tokens apart in lists) and the SHA-256 of the whole key (`digest`). Written only by
    genserver/jobs/services/tokens.py, which makes, checks and revokes keys.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True, default="", help_text="what the token is for")
    prefix = models.CharField(max_length=16, db_index=True, help_text="the key's first characters (not secret)")
    digest = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the key, hex")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="empty: never expires")
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, help_text="set: refused from that moment on")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or 'unnamed'}) of {self.user_id}"

    def state(self, now: datetime | None = None) -> str:
        """`active`, `expired` or `revoked`."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= (now or timezone.now()):
            return "expired"
        return "active"
