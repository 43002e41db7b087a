"""The decode workers' queue as a picture of the queue reads it: with the running jobs, in one statement."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from genserver.jobs.models import Job, JobStage, JobStatus
from genserver.jobs.selectors.decode_queue import decoding_rows
from genserver.jobs.selectors.positions import QueueSnapshot, running_and_decoding, running_jobs
from tests.support.jobs import make_job

# (status, stage, holder): queued, waiting between chunks, on a card, decoding queued and in service, ended
STATES = [
    (JobStatus.QUEUED, JobStage.QUEUED, ""),
    (JobStatus.DENOISING, JobStage.WAITING, ""),
    (JobStatus.DENOISING, JobStage.DENOISING, "card0@n1:1"),
    (JobStatus.DECODING, JobStage.WAITING, ""),
    (JobStatus.DECODING, JobStage.DECODING, "decode@n1:2"),
    (JobStatus.SUCCEEDED, JobStage.DONE, ""),
]


@pytest.mark.django_db
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_statement_reads_the_running_jobs_and_the_decode_queue_as_their_own_reads_do(django_user_model, seed):
    rng = random.Random(seed)
    owner = django_user_model.objects.create_user(f"decode-queue-{seed}")
    now = timezone.now()
    moments = [None, now, now - timedelta(seconds=3), now - timedelta(seconds=1)]  # ties and unpublished too
    for i in range(30):
        status, stage, holder = rng.choice(STATES)
        make_job(owner, seed=i, status=status, stage=stage, lease_owner=holder, published_at=rng.choice(moments))
    assert Job.objects.filter(status=JobStatus.DECODING).count() >= 3, "the seed draws a decode queue"

    with CaptureQueriesContext(connection) as read:
        running, decoding = running_and_decoding()
    assert len(read.captured_queries) == 1
    assert sorted(j.pk for j in running) == sorted(j.pk for j in running_jobs())
    assert decoding == decoding_rows()  # the same rows, first published first


@pytest.mark.django_db
def test_a_snapshot_and_a_submits_answer_read_the_decode_queue_with_the_running_jobs(django_user_model):
    owner = django_user_model.objects.create_user("decode-queue-snapshot")
    make_job(owner, status=JobStatus.DECODING, stage=JobStage.WAITING, published_at=timezone.now())
    snapshot = QueueSnapshot.load()
    with CaptureQueriesContext(connection) as read:
        rows = snapshot._decoding_rows()  # as an ETA asks for them
    assert read.captured_queries == [] and rows == decoding_rows()
