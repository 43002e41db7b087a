"""A new job's INSERT with its text kept per connection (services/_common.insert_job): the row Django's save writes."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Value
from django.forms.models import model_to_dict
from django.utils import timezone

from genserver.jobs.models import Job, JobStatus
from genserver.jobs.services import _common

pytestmark = pytest.mark.django_db

VALUES = dict(
    model="sdxl-sim",
    family="sdxl",
    kind="image",
    backend="sim",
    prompt="a fox, ünïcode and 'quotes'",
    width=512,
    height=768,
    num_frames=1,
    steps=20,
    guidance_scale=5.5,
    seed=2**62,
    num_outputs=2,
    webhook_events=["started", "failed"],
    estimated_seconds=1.25,
    clock_scale=0.5,
    duration_class="short",
    queue="short",
    priority=3,
    chunk_steps=10,
    status=JobStatus.DENOISING,
    held=False,
    outputs=[{"key": "o/0.png", "content_type": "image/png"}],
    charged_card_seconds=0.625,
)


def _row(job_id) -> dict:
    row = model_to_dict(Job.objects.get(pk=job_id), exclude=["id"])
    return row | {"times": [Job.objects.values_list(f, flat=True).get(pk=job_id) for f in ("created_at", "updated_at")]}


def test_each_insert_writes_the_row_djangos_save_writes(make_user):
    owner = make_user("alice").user
    deadline = timezone.now() + timedelta(seconds=90)
    saved = Job(owner=owner, start_deadline=deadline, published_at=deadline, **VALUES)
    saved.save(force_insert=True)
    for _ in range(3):  # the first insert goes through Django and keeps the statement; the others bind it
        job = Job(owner=owner, start_deadline=deadline, published_at=deadline, **VALUES)
        _common.insert_job(job)
        assert not job._state.adding and job._state.db == "default"
        ours, theirs = _row(job.pk), _row(saved.pk)
        assert ours.pop("times")[0] >= theirs.pop("times")[0]  # the clock of its own insert
        assert ours == theirs
        assert job.created_at == Job.objects.get(pk=job.pk).created_at  # as save sets it on the instance


def test_a_job_holding_an_expression_is_saved_by_django(make_user):
    owner = make_user("bob").user
    _common.insert_job(Job(owner=owner, **VALUES))  # the statement kept
    job = Job(owner=owner, **(VALUES | {"prompt": Value("from an expression")}))
    _common.insert_job(job)
    assert Job.objects.get(pk=job.pk).prompt == "from an expression"


def test_empty_columns_are_written_null_and_the_rest_bound(make_user):
    """Each set of empty columns gets its own text; the rows are Django's, and the INSERT binds fewer values than
    psycopg's parsed-statement cache takes (50), so it is not parsed again at every submit."""
    owner = make_user("carol").user
    deadline = timezone.now() + timedelta(seconds=90)
    _common.insert_job(Job(owner=owner, **VALUES))  # the statement kept
    executed: list[tuple[str, int]] = []

    def record(execute, sql, params, many, context):
        if sql.startswith("INSERT"):
            executed.append((sql, len(params)))
        return execute(sql, params, many, context)

    for extra in ({}, {"start_deadline": deadline, "steps_requested": 30}, {}):
        saved = Job(owner=owner, **(VALUES | extra))
        saved.save(force_insert=True)
        job = Job(owner=owner, **(VALUES | extra))
        with connection.execute_wrapper(record):
            _common.insert_job(job)
        ours, theirs = _row(job.pk), _row(saved.pk)
        ours.pop("times"), theirs.pop("times")
        assert ours == theirs
    (first, bound), (second, bound_more), (third, _) = executed
    assert first == third and first != second
    assert bound_more == bound + 2 and bound <= 50
    assert first.count("NULL") == len(Job._meta.local_concrete_fields) - bound
