"""A job's row as a chunk message carries it: JSON-safe values, and the Job built back from them.

The publisher of a job's first chunk has the row it just wrote; a card that gets it in the message can begin the
job's first step while its claim is on the way to the database (tasks/denoise.py), instead of after it. The
claim's row then confirms the copy (`same_first_steps`) or the step is thrown away.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import Field

from genserver.jobs.models import Job

# Every field a step reads before the claim confirms the copy: a row that differs in one of them (the total
# changed by POST /steps/ between the publish and the claim) makes the step a different one.
FIRST_STEP_FIELDS = (
    "model",
    "prompt",
    "negative_prompt",
    "width",
    "height",
    "num_frames",
    "steps",
    "guidance_scale",
    "seed",
    "num_outputs",
    "preview_every",
    "chunk_steps",
    "segment_frames",
    "segment_count",
    "embeddings_key",
    "checkpoint_step",
    "checkpoint_key",
)

_FIELDS: list[Field] = list(Job._meta.concrete_fields)
_NAMES = [field.attname for field in _FIELDS]


def row_of(job: Job) -> dict[str, Any]:
    """Every column of `job` as JSON can carry it (UUIDs and datetimes as text)."""
    row: dict[str, Any] = {}
    for field in _FIELDS:
        value = getattr(job, field.attname)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, uuid.UUID):
            value = str(value)
        row[field.attname] = value
    return row


def job_from_row(row: dict[str, Any]) -> Job | None:
    """The Job that `row_of` described, as a read would give it; None when the row lacks a column (a publisher
    of another version) or a value does not convert."""
    try:
        values = [field.to_python(row[field.attname]) for field in _FIELDS]
    except (KeyError, TypeError, ValueError, ValidationError):  # ValidationError: a value not of the column's type
        return None
    return Job.from_db(Job.objects.db, _NAMES, values)


def same_first_steps(copy: Job, row: Job) -> bool:
    """Whether a step begun from `copy` is the step `row` (the claim's) would run."""
    return all(getattr(copy, name) == getattr(row, name) for name in FIRST_STEP_FIELDS)


def adopt(copy: Job, row: Job) -> None:
    """`copy` becomes `row` in place (whoever holds the copy holds the claimed row)."""
    for field in _FIELDS:
        setattr(copy, field.attname, getattr(row, field.attname))
