"""A job's answer: JobSerializer's own rendering says what DRF's field-by-field rendering says, in every state."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework import serializers
from rest_framework.test import APIRequestFactory

from genserver.jobs import selectors
from genserver.jobs.api.serializers import JobCreateSerializer, JobSerializer
from genserver.jobs.models import JobSegment, JobStage, JobStatus, SegmentStatus
from tests.support.jobs import make_job

pytestmark = pytest.mark.django_db

WAN_LONG = {"model": "wan-sim", "width": 1280, "height": 720, "num_frames": 241, "steps": 20}


def _jobs_in_every_state(owner):
    now = timezone.now()
    held = make_job(owner, held=True, status=JobStatus.QUEUED, stage=JobStage.QUEUED, published_at=None)
    queued = make_job(
        owner, {"prompt": "a fox", "seed": 2**62}, published_at=now, start_deadline=now + timedelta(seconds=90.5)
    )
    running = make_job(
        owner,
        status=JobStatus.DENOISING,
        stage=JobStage.DENOISING,
        published_at=now,
        started_at=now - timedelta(seconds=3),
        steps_done=7,
        preview_key="previews/x.png",
        preview_step=6,
        cancel_requested=True,
        webhook_url="https://hooks.example.com/genserver",
        webhook_events=["succeeded", "failed"],
    )
    done = make_job(
        owner,
        {"num_outputs": 2, "negative_prompt": "blur"},
        status=JobStatus.SUCCEEDED,
        stage=JobStage.DONE,
        started_at=now - timedelta(seconds=5),
        finished_at=now,
        steps_done=20,
        steps_requested=30,
        attempts=2,
        outputs=[{"key": "o/0.png", "content_type": "image/png"}, {"key": "o/1.png", "content_type": "image/png"}],
    )
    failed = make_job(owner, status=JobStatus.FAILED, stage=JobStage.FAILED, finished_at=now, error="out of memory")
    video = make_job(owner, WAN_LONG, status=JobStatus.DENOISING, stage=JobStage.DENOISING, published_at=now)
    assert video.segment_count > 1  # a long video: its published segments are listed
    for index, status in enumerate((SegmentStatus.PUBLISHED, SegmentStatus.DENOISED)):
        JobSegment.objects.create(
            job=video, index=index, frames=video.segment_frames, seed=11 + index, status=status, key=f"s/{index}.mp4"
        )
    return [held, queued, running, done, failed, video]


def test_the_answer_is_drfs_own_rendering_of_each_field_for_jobs_in_every_state(make_user):
    owner = make_user("renders").user
    jobs = _jobs_in_every_state(owner)
    page = list(selectors.jobs_visible_to(owner).select_related("owner").prefetch_related("segments"))
    snapshot = selectors.QueueSnapshot.load()
    snapshot.prepare(page)
    context = {"request": APIRequestFactory().get("/api/v1/jobs/"), "snapshot": snapshot}
    assert len(page) == len(jobs)
    for job in page:
        fast = JobSerializer(job, context=context)
        drf = JobSerializer(job, context=context)
        expected = serializers.ModelSerializer.to_representation(drf, job)  # every field bound and rendered
        answer = fast.data
        assert list(answer) == list(expected) == JobSerializer.Meta.fields
        assert answer == expected, job.status
    listed = JobSerializer(page, many=True, context=context).data
    assert [dict(item) for item in listed] == [JobSerializer(j, context=context).data for j in page]
    # The states above reach the fields' renderings that differ from the stored value.
    running = next(item for item in listed if item["status"] == JobStatus.DENOISING and item["preview_url"])
    assert running["started_at"].endswith("Z") and running["preview_url"].endswith("/preview/")
    assert any(len(item["segments"]) == 1 for item in listed)


REQUESTS = [
    {"model": "sdxl-sim", "prompt": "a fox"},
    {"model": "sdxl-sim", "prompt": "  padded  ", "width": 768, "height": 512, "seed": 7, "num_outputs": 2},
    {"model": "wan-sim", "prompt": "a river", "num_frames": 33, "steps": 12, "lane": "interactive"},
    {
        "model": "sdxl-sim",
        "prompt": "hooks",
        "webhook_url": "https://hooks.example.com/x",
        "webhook_events": ["failed", "started", "failed"],
    },
    {"model": "sdxl-sim", "prompt": "", "width": 0, "steps": "ten", "webhook_events": ["nope"], "extra": 1},
    {"model": "no-such-model", "prompt": "x", "seed": -1, "guidance_scale": 1e9, "lane": "Not A Lane"},
    {"model": "sdxl-sim", "prompt": "x", "num_frames": 2, "width": 1000, "start_within": 10**9},
    ["not", "an", "object"],
]


class _DeepCopied(JobCreateSerializer):
    """The same serializer with DRF's own fields: every declared field deep-copied and bound for each instance."""

    fields = serializers.Serializer.fields


def _outcome(serializer_class, data):
    serializer = serializer_class(data=data)
    valid = serializer.is_valid()
    values = {k: v for k, v in serializer.validated_data.items() if k != "seed"} if valid else None
    return valid, values, serializer.errors


@pytest.mark.parametrize("data", REQUESTS, ids=range(len(REQUESTS)))
def test_the_request_is_validated_as_with_drfs_deep_copied_fields(data):
    assert _outcome(JobCreateSerializer, data) == _outcome(_DeepCopied, data)


def test_threads_validating_at_once_with_the_shared_fields_answer_as_each_alone():
    """Every instance shares one set of fields; eight threads validating different requests at once get each
    request's own answer (DRF's copies, one request at a time)."""
    expected = [_outcome(_DeepCopied, data) for data in REQUESTS]
    first, second = JobCreateSerializer(data=REQUESTS[0]), JobCreateSerializer(data=REQUESTS[2])
    assert first.fields is second.fields  # shared, not copied per request
    start = threading.Barrier(8)

    def validate_all(offset: int) -> list:
        start.wait()
        order = [(offset + i) % len(REQUESTS) for i in range(len(REQUESTS) * 25)]
        return [(i, _outcome(JobCreateSerializer, REQUESTS[i])) for i in order]

    with ThreadPoolExecutor(8) as pool:
        for answers in pool.map(validate_all, range(8)):
            for i, outcome in answers:
                assert outcome == expected[i], REQUESTS[i]
