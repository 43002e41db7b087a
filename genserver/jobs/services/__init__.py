"""The job service: every write to a Job, and the only code that changes `status`.

Each transition is one conditional UPDATE (compare-and-set on status, lease
and checkpoint step), so two workers, a redelivered message and the reaper
can race on a job and exactly one of them wins. Tasks are published only
after the transaction that made them valid commits.

The modules follow the job's life: `quotas` (per-user limits and allowed
models/lanes at submit, the charge settled at the end), `submission` (admission,
idempotency, cancel), `deadlines` (the start deadline: a refused quote,
the end `expired`), `priority` (staff re-prioritise within a class), `estimates` (cost and the online step-time
correction), `steps` (step changes midway), `transitions` (the worker's
claims, heartbeats, chunks and decode), `recovery` (failed attempts, the
reaper, the admin's retry), `overload` (the long cap, decided on every
reaper tick), `retention`; `_common` holds what they and segment_service.py
share. Callers use the names re-exported here.
"""

from __future__ import annotations

from ._common import Outcome, disk_full, publish_or_leave_to_reaper
from .deadlines import StartDeadlineRefused, expire_if_overdue, expire_overdue
from .estimates import Estimate, estimate, learn_stage_seconds
from .overload import update_long_cap
from .priority import PriorityRefused, priority_bounds, reprioritise
from .quotas import InFlightLimitReached, NotAllowed, QuotaExceeded, settle
from .recovery import fail_attempt, reap_stale, retry_failed
from .retention import expire_failed_checkpoints, expire_outputs, job_deleted, purge_jobs, retain, sweep_embeddings
from .steps import STEPS_CHANGEABLE, StepsChangeRefused, change_steps, release_for_new_total
from .submission import (
    AdmissionRefused,
    IdempotencyConflict,
    cancel_job,
    fingerprint,
    replayed_job,
    submit,
    submit_job,
    submit_or_replay,
)
from .transitions import (
    claim_chunk,
    claim_encode_batch,
    claim_merge_partners,
    finish_cancelled,
    finish_chunk,
    finish_decoding,
    finish_encoding,
    heartbeat,
    learn_from_chunk,
    record_first_step,
    record_preview,
    resume_from_earlier_checkpoint,
    start_decoding,
    start_encoding,
)

__all__ = [
    "learn_stage_seconds",
    "AdmissionRefused",
    "Estimate",
    "IdempotencyConflict",
    "InFlightLimitReached",
    "NotAllowed",
    "Outcome",
    "PriorityRefused",
    "QuotaExceeded",
    "STEPS_CHANGEABLE",
    "StartDeadlineRefused",
    "StepsChangeRefused",
    "cancel_job",
    "change_steps",
    "claim_chunk",
    "claim_encode_batch",
    "claim_merge_partners",
    "disk_full",
    "estimate",
    "expire_failed_checkpoints",
    "expire_if_overdue",
    "expire_outputs",
    "expire_overdue",
    "fail_attempt",
    "resume_from_earlier_checkpoint",
    "fingerprint",
    "finish_cancelled",
    "finish_chunk",
    "learn_from_chunk",
    "finish_decoding",
    "finish_encoding",
    "heartbeat",
    "job_deleted",
    "priority_bounds",
    "publish_or_leave_to_reaper",
    "purge_jobs",
    "reap_stale",
    "record_first_step",
    "record_preview",
    "release_for_new_total",
    "replayed_job",
    "reprioritise",
    "retain",
    "retry_failed",
    "settle",
    "start_decoding",
    "start_encoding",
    "submit",
    "submit_job",
    "submit_or_replay",
    "sweep_embeddings",
    "update_long_cap",
]
