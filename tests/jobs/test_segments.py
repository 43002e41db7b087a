"""The job service's segment transitions, on the database alone (no worker takes these rows)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from genserver.jobs import segment_service, services
from genserver.jobs.models import Job, JobSegment, JobStatus, SegmentStatus
from tests.support.broker import capture_sends
from tests.support.jobs import make_job

pytestmark = pytest.mark.django_db

LONG = {
    "model": "wan-sim",
    "width": 832,
    "height": 480,
    "num_frames": 241,
    "steps": 20,
    "guidance_scale": 5.0,
    "num_outputs": 1,
}


@pytest.fixture
def sent(monkeypatch):
    """Messages the service would publish: ("decode", job, index) and ("assemble", job)."""
    return capture_sends(
        monkeypatch,
        send_segment_decode=lambda job_id, index, p: ("decode", index),
        send_assemble=lambda job_id, p: ("assemble",),
        send_decode=lambda job_id, p, model="": ("job-decode",),
    )


@pytest.fixture
def video(django_user_model):
    est = services.estimate(LONG | {"seed": 9})
    assert est.segment_count == 3 and est.segment_frames == 81
    owner = django_user_model.objects.create_user("seg-owner")
    return make_job(
        owner,
        LONG | {"seed": 9},
        status=JobStatus.DENOISING,
        embeddings_key="e",
        lease_owner="card",
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )


def denoise_to(job: Job, step: int, captured) -> bool:
    """The card records a checkpoint at global `step` (keeping its lease, as the in-process loop does)."""
    with captured(execute=True):
        return services.finish_chunk(
            job.pk, "card", step, f"checkpoints/{job.pk}/s{step}.pt", None, keep_lease=step < job.total_steps
        )


def test_estimate_counts_every_segment():
    one = services.estimate(LONG | {"num_frames": 81})
    three = services.estimate(LONG | {"num_frames": 243})
    assert one.segment_count == 1 and three.segment_count == 3
    assert three.seconds == pytest.approx(3 * one.seconds)
    assert three.chunk_steps == one.chunk_steps  # chunks never span segments: same per-step cost
    assert three.duration_class == "long"


def test_a_segment_is_published_at_its_end_while_the_card_goes_on(video, sent, django_capture_on_commit_callbacks):
    assert denoise_to(video, 10, django_capture_on_commit_callbacks) and sent == []
    assert denoise_to(video, 20, django_capture_on_commit_callbacks)
    assert sent == [("decode", 0)]
    job = Job.objects.get(pk=video.pk)
    assert job.status == JobStatus.DENOISING and job.lease_owner == "card" and job.steps_done == 20
    row = JobSegment.objects.get(job=video, index=0)
    assert row.status == SegmentStatus.DENOISED and row.frames == 81 and row.seed == 9
    assert row.checkpoint_key.endswith("s20.pt")
    assert job.remaining_seconds == pytest.approx(job.estimated_seconds * 40 / 60)


def test_duplicate_decode_messages_take_and_publish_a_segment_once(video, sent, django_capture_on_commit_callbacks):
    denoise_to(video, 20, django_capture_on_commit_callbacks)
    job, segment = segment_service.start_segment_decode(video.pk, 0, "dec-a")
    assert segment.status == SegmentStatus.DECODING
    assert segment_service.start_segment_decode(video.pk, 0, "dec-b") is None  # held
    assert not segment_service.finish_segment_decode(video.pk, 0, "dec-b", "x.mp4", "x.png")
    with django_capture_on_commit_callbacks(execute=True):
        assert segment_service.finish_segment_decode(video.pk, 0, "dec-a", "a.mp4", "a.png")
    assert segment_service.start_segment_decode(video.pk, 0, "dec-b") is None  # published: a redelivery
    assert not segment_service.finish_segment_decode(video.pk, 0, "dec-a", "b.mp4", "b.png")
    row = JobSegment.objects.get(job=video, index=0)
    assert (row.status, row.key, JobSegment.objects.filter(job=video).count()) == ("published", "a.mp4", 1)
    assert ("assemble",) not in sent  # the job is still denoising


def test_the_whole_video_is_assembled_once_every_segment_is_published(video, sent, django_capture_on_commit_callbacks):
    for step in (20, 40):
        denoise_to(video, step, django_capture_on_commit_callbacks)
    for index in (0, 1):
        segment_service.start_segment_decode(video.pk, index, "dec")
        with django_capture_on_commit_callbacks(execute=True):
            segment_service.finish_segment_decode(video.pk, index, "dec", f"{index}.mp4", f"{index}.png")
    assert segment_service.start_assembly(video.pk, "dec") is None  # still denoising
    denoise_to(video, 60, django_capture_on_commit_callbacks)
    job = Job.objects.get(pk=video.pk)
    assert job.status == JobStatus.DECODING and not job.lease_owner
    assert ("job-decode",) not in sent and sent[-1] == ("decode", 2)
    assert segment_service.start_assembly(video.pk, "dec") is None  # segment 2 is not published yet
    segment_service.start_segment_decode(video.pk, 2, "dec")
    with django_capture_on_commit_callbacks(execute=True):
        segment_service.finish_segment_decode(video.pk, 2, "dec", "2.mp4", "2.png")
    assert sent[-1] == ("assemble",)
    job, segments = segment_service.start_assembly(video.pk, "dec")
    assert [s.key for s in segments] == ["0.mp4", "1.mp4", "2.mp4"]
    assert segment_service.start_assembly(video.pk, "dec2") is None  # a duplicate assembly does nothing


@override_settings(MAX_ATTEMPTS=3)
def test_a_failing_segment_decode_is_retried_then_fails_the_job(
    video, sent, django_capture_on_commit_callbacks, monkeypatch
):
    monkeypatch.setattr(segment_service, "after_end", lambda job_id: None)
    denoise_to(video, 20, django_capture_on_commit_callbacks)
    outcomes = []
    for attempt in range(3):
        assert segment_service.start_segment_decode(video.pk, 0, f"dec{attempt}") is not None
        with django_capture_on_commit_callbacks(execute=True):
            outcomes.append(segment_service.fail_segment_decode(video.pk, 0, f"dec{attempt}", "boom\nOSError: x"))
    assert outcomes == ["retried", "retried", "failed"]
    assert sent.count(("decode", 0)) == 3  # the first publish and two retries
    job = Job.objects.get(pk=video.pk)
    assert job.status == JobStatus.FAILED and "segment 0" in job.error and "gave up after 3" in job.error
    assert JobSegment.objects.get(job=video, index=0).status == SegmentStatus.FAILED


def test_reaper_retries_a_dead_decoder_and_republishes_a_lost_message(
    video, sent, django_capture_on_commit_callbacks, monkeypatch
):
    from genserver.jobs import broker

    monkeypatch.setattr(broker, "broker_job_ids", lambda queues: set())  # nothing waits in the broker
    for step in (20, 40):
        denoise_to(video, step, django_capture_on_commit_callbacks)
    sent.clear()
    segment_service.start_segment_decode(video.pk, 0, "dead-decoder")
    past = timezone.now() - timedelta(seconds=60)
    JobSegment.objects.filter(job=video, index=0).update(lease_expires_at=past)
    JobSegment.objects.filter(job=video, index=1).update(published_at=past)
    with django_capture_on_commit_callbacks(execute=True):
        outcomes = segment_service.reap_segments()
    assert outcomes == {"retried": 1, "republished": 1}
    assert sorted(sent) == [("decode", 0), ("decode", 1)]
    row = JobSegment.objects.get(job=video, index=0)
    assert row.status == SegmentStatus.DENOISED and row.attempts == 1 and "stopped renewing" in row.error
    with django_capture_on_commit_callbacks(execute=True):
        assert segment_service.reap_segments() == {}  # both were just published again


def test_cancel_stops_new_segment_decodes_and_keeps_published_ones(video, sent, django_capture_on_commit_callbacks):
    for step in (20, 40):
        denoise_to(video, step, django_capture_on_commit_callbacks)
    segment_service.start_segment_decode(video.pk, 0, "dec")
    segment_service.finish_segment_decode(video.pk, 0, "dec", "0.mp4", "0.png")
    Job.objects.filter(pk=video.pk).update(lease_owner="")
    services.cancel_job(Job.objects.get(pk=video.pk))
    job = Job.objects.get(pk=video.pk)
    assert job.status == JobStatus.CANCELLED
    assert segment_service.start_segment_decode(video.pk, 1, "dec") is None
    assert list(JobSegment.objects.filter(job=video, status="published").values_list("index", flat=True)) == [0]


@override_settings(OUTPUT_TTL_SECONDS=60)
def test_retention_expires_a_cancelled_videos_segments(video, sent, django_capture_on_commit_callbacks):
    denoise_to(video, 20, django_capture_on_commit_callbacks)
    segment_service.start_segment_decode(video.pk, 0, "dec")
    segment_service.finish_segment_decode(video.pk, 0, "dec", "0.mp4", "0.png")
    Job.objects.filter(pk=video.pk).update(status=JobStatus.CANCELLED, finished_at=timezone.now())
    assert services.expire_outputs() == 0 and JobSegment.objects.filter(job=video).count() == 1  # kept a while
    Job.objects.filter(pk=video.pk).update(finished_at=timezone.now() - timedelta(seconds=120))
    assert services.expire_outputs() == 1 and not JobSegment.objects.filter(job=video).exists()


def test_a_video_that_fits_in_one_segment_is_unchanged():
    est = services.estimate(LONG | {"num_frames": 81})
    assert (est.segment_count, est.segment_frames) == (1, 0)


def test_admin_retry_of_a_failed_video_restarts_at_the_first_unpublished_segment(
    video, sent, django_capture_on_commit_callbacks, monkeypatch
):
    monkeypatch.setattr(segment_service, "after_end", lambda job_id: None)
    for step in (20, 40):
        denoise_to(video, step, django_capture_on_commit_callbacks)
    segment_service.start_segment_decode(video.pk, 0, "dec")
    segment_service.finish_segment_decode(video.pk, 0, "dec", "0.mp4", "0.png")
    with override_settings(MAX_ATTEMPTS=1):
        segment_service.start_segment_decode(video.pk, 1, "dec")
        assert segment_service.fail_segment_decode(video.pk, 1, "dec", "boom") == "failed"
    sent.clear()
    capture_sends(monkeypatch, into=sent, send_chunk=lambda job_id, step, q, p, *model: ("chunk", step))
    assert services.retry_failed(Job.objects.get(pk=video.pk))
    job = Job.objects.get(pk=video.pk)
    assert (job.status, job.checkpoint_step, job.steps_done, job.checkpoint_key) == ("denoising", 20, 20, "")
    assert sent == [("chunk", 20)]  # segment 1 again, from its seed; segment 0 stays published
    assert list(JobSegment.objects.filter(job=video).values_list("index", "status")) == [(0, "published")]


def test_admin_retry_of_a_video_failed_midway_through_a_segment_resumes_at_its_kept_checkpoint(
    video, sent, django_capture_on_commit_callbacks, monkeypatch
):
    from genserver.storage import default_storage

    storage = default_storage()
    for step in (20, 30):
        storage.put(f"checkpoints/{video.pk}/s{step}.pt", b"state")
        denoise_to(video, step, django_capture_on_commit_callbacks)
    segment_service.start_segment_decode(video.pk, 0, "dec")
    segment_service.finish_segment_decode(video.pk, 0, "dec", "0.mp4", "0.png")
    with override_settings(MAX_ATTEMPTS=1), django_capture_on_commit_callbacks(execute=True):
        assert services.fail_attempt(video.pk, "card", "RuntimeError: boom") == "failed"
    assert [e.key for e in storage.list(f"checkpoints/{video.pk}")] == [f"checkpoints/{video.pk}/s30.pt"]
    sent.clear()
    capture_sends(monkeypatch, into=sent, send_chunk=lambda job_id, step, q, p, *model: ("chunk", step))
    assert services.retry_failed(Job.objects.get(pk=video.pk))
    job = Job.objects.get(pk=video.pk)
    assert (job.status, job.checkpoint_step, job.steps_done) == ("denoising", 30, 30)
    assert job.checkpoint_key == f"checkpoints/{video.pk}/s30.pt"
    assert sent == [("chunk", 30)]  # segment 1 from step 10 of its 20; segment 0 stays published
    assert list(JobSegment.objects.filter(job=video).values_list("index", "status")) == [(0, "published")]
    storage.delete_prefix(f"checkpoints/{video.pk}")


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"num_frames": 961}, None),  # 60 s at 16 fps: 12 segments
        ({"num_frames": 965}, "num_frames"),
        ({"num_frames": 161, "num_outputs": 2}, "num_outputs"),  # a segmented video makes one output
        ({"num_frames": 81, "num_outputs": 2}, "num_outputs"),  # wan-sim leaves max_batch at 1
        ({"num_frames": 81, "num_outputs": 1}, None),
    ],
)
def test_request_limits_of_long_videos(fields, error):
    from genserver.jobs.api.serializers import JobCreateSerializer

    incoming = JobCreateSerializer(data={"model": "wan-sim", "prompt": "p"} | fields)
    assert incoming.is_valid() == (error is None), incoming.errors
    if error:
        assert error in incoming.errors
