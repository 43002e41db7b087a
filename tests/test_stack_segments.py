"""Long videos in segments, end to end on real workers: staggered decode, the whole video, cancel, recovery."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from genserver.jobs.models import JobSegment
from tests.support.api import download, submit
from tests.support.waits import finished, job_row, settled, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]

# 3 segments of 5 s (81, 81, 79 frames = 15 s at 16 fps); each segment is 1,330 s of work → 2.7 s on the
# test clock, so the decode of one overlaps the denoising of the next.
LONG = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 241, "steps": 100}


def frame_count(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as container:
        return sum(1 for _ in container.decode(video=0))


def first_segment_while_denoising(api, job_id):
    """Poll the API until segment 0 is listed; return that body (and whether the card was still denoising)."""

    def poll():
        body = api.get(f"/api/v1/jobs/{job_id}/").json()
        return body if body["segments"] or body["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_for(poll, 60, interval=0.05, what="segment 0 to be published")


def test_long_video_publishes_segments_while_denoising_then_the_whole_video(stack, api):
    response = submit(api, prompt="a long walk on the beach", seed=42, **LONG)
    assert response.status_code == 201, response.content
    created = response.json()
    assert created["segment_count"] == 3 and created["progress"] == {"step": 0, "total_steps": 300}
    assert created["duration_class"] == "long" and created["segments"] == []
    # Costed by its expected duration: three segments of 81 generated frames, 3× a one-segment video.
    from genserver.jobs import services

    one = services.estimate(
        {
            "model": "wan-sim",
            "width": 832,
            "height": 480,
            "num_frames": 81,
            "steps": 100,
            "guidance_scale": 5.0,
            "num_outputs": 1,
        }
    )
    assert created["estimated_seconds"] == pytest.approx(3 * one.seconds * one.clock_scale, rel=1e-3)
    job_id = created["id"]

    early = first_segment_while_denoising(api, job_id)
    assert early["status"] == "denoising", "segment 0 was not published while later segments denoised"
    assert early["segments"][0]["index"] == 0 and early["segments"][0]["frames"] == 81
    assert 100 <= early["progress"]["step"] < 300
    assert frame_count(download(api, early["segments"][0]["url"])) == 81  # downloadable at once

    job = finished(job_id)
    assert job.status == "succeeded", job.error
    body = api.get(f"/api/v1/jobs/{job_id}/").json()
    assert body["progress"] == {"step": 300, "total_steps": 300}
    assert [(s["index"], s["frames"], s["content_type"]) for s in body["segments"]] == [
        (0, 81, "video/mp4"),
        (1, 81, "video/mp4"),
        (2, 79, "video/mp4"),
    ]
    assert body["segments"][0]["seed"] == 42 and len({s["seed"] for s in body["segments"]}) == 3
    for segment in body["segments"]:
        assert frame_count(download(api, segment["url"])) == segment["frames"]
        assert download(api, segment["poster_url"]).startswith(b"\x89PNG")
    assert [o["content_type"] for o in body["outputs"]] == ["video/mp4", "image/png"]
    assert frame_count(download(api, body["outputs"][0]["url"])) == 241  # the whole video
    assert download(api, body["outputs"][1]["url"]).startswith(b"\x89PNG")
    # Every decode overlapped: segment 0 and 1 were decoded before the card finished denoising.
    decoded = {s.index: s.decoded_at for s in JobSegment.objects.filter(job_id=job_id)}
    assert decoded[0] < decoded[2] and job.finished_at >= decoded[2]
    assert api.get(f"/api/v1/jobs/{job_id}/segments/7/").status_code == 404


def test_segments_are_owner_only(stack, api, make_user):
    job_id = submit(api, prompt="mine", **(LONG | {"num_frames": 85, "steps": 20})).json()["id"]
    assert finished(job_id).status == "succeeded"
    url = f"/api/v1/jobs/{job_id}/segments/0/"
    assert api.get(url).status_code == 200
    assert make_user("mallory").get(url).status_code == 404
    assert make_user("staff", staff=True).get(url).status_code == 200
    body = api.get(f"/api/v1/jobs/{job_id}/").json()
    assert [(s["frames"]) for s in body["segments"]] == [81, 4]  # 85 frames: 81 + 4 (of 5 generated)
    assert frame_count(download(api, body["outputs"][0]["url"])) == 85


def test_cancel_after_the_first_segment_keeps_it(stack, api):
    from genserver.jobs import services

    job_id = submit(api, prompt="cancel me halfway", preview_every=1, **LONG).json()["id"]
    early = first_segment_while_denoising(api, job_id)
    assert early["status"] == "denoising"
    assert api.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 202
    flagged_by = job_row(job_id).preview_step  # a preview every step: the step reached, recorded as it happens
    job = finished(job_id, timeout=30)
    # Stopped within a step of the flag (only the step then running completed), not at the segment's end.
    assert job.status == "cancelled" and job.preview_step <= flagged_by + 1, (job.preview_step, flagged_by)
    assert job.steps_done < job.total_steps and not job.outputs
    services.reap_stale()  # the reaper and retention have their turn: the segment stays
    services.retain()
    body = api.get(f"/api/v1/jobs/{job_id}/").json()
    assert body["status"] == "cancelled" and body["segments"] and body["segments"][0]["index"] == 0
    assert frame_count(download(api, body["segments"][0]["url"])) == 81
    assert frame_count(download(api, f"/api/v1/jobs/{job_id}/segments/0/")) == 81


def test_redelivered_segment_decode_does_not_duplicate_a_segment(stack, api):
    from genserver.jobs import broker
    from genserver.storage import default_storage

    job_id = submit(api, prompt="twice", **(LONG | {"num_frames": 161, "steps": 20})).json()["id"]
    job = finished(job_id)
    assert job.status == "succeeded", job.error
    before = {s.index: (s.key, s.decoded_at, s.attempts) for s in JobSegment.objects.filter(job_id=job_id)}
    mtime = default_storage().path(before[0][0]).stat().st_mtime_ns
    for index in (0, 1, 0):
        broker.send_segment_decode(job_id, index, 0)
    broker.send_assemble(job_id, 0)
    settled(["decode"])  # the duplicates were consumed and ran
    after = {s.index: (s.key, s.decoded_at, s.attempts) for s in JobSegment.objects.filter(job_id=job_id)}
    assert after == before and len(after) == 2
    assert default_storage().path(before[0][0]).stat().st_mtime_ns == mtime
    body = api.get(f"/api/v1/jobs/{job_id}/").json()
    assert [s["index"] for s in body["segments"]] == [0, 1] and body["status"] == "succeeded"


def test_lost_segment_decode_messages_are_republished_by_the_reaper(stack, api, redis_conn):
    from genserver.jobs.broker import queue_keys

    stack.kill("decode")  # nothing consumes decode messages for now
    try:
        job_id = submit(api, prompt="lost and found", **(LONG | {"num_frames": 161, "steps": 20})).json()["id"]
        wait_for(lambda: JobSegment.objects.filter(job_id=job_id).count() == 2, 60, what="both segments denoised")
        redis_conn.delete(*queue_keys("decode"))  # Redis lost them
    finally:
        stack.wait_ready()  # the launcher restarts the decode worker
    job = finished(job_id, timeout=60)
    assert job.status == "succeeded", job.error
    assert JobSegment.objects.filter(job_id=job_id, status="published").count() == 2


def test_worker_killed_mid_segment_resumes_from_its_checkpoint(stack, api):
    job_id = submit(api, prompt="killed in segment 1", **(LONG | {"num_frames": 161, "steps": 60})).json()["id"]
    wait_for(lambda: job_row(job_id).checkpoint_step >= 60 + 10, 60, what="ten steps into segment 1")
    stack.kill("card0")
    at_kill = job_row(job_id)
    stack.wait_ready()
    job = finished(job_id)
    assert job.status == "succeeded", job.error
    assert 70 <= at_kill.checkpoint_step < 120 and job.attempts <= 1
    assert job.chunks_run <= 2 * -(-job.steps // job.chunk_steps) + 1, "more than the interrupted chunk was redone"
    assert [s.frames for s in JobSegment.objects.filter(job_id=job_id).order_by("index")] == [81, 80]


def pixel_differences(a: bytes, b: bytes) -> list[tuple[int, float]]:
    """Per frame of two clips: (the largest difference of their pixels, the mean one), in levels of 255."""

    def frames(data: bytes) -> list[np.ndarray]:
        with av.open(io.BytesIO(data)) as container:
            return [np.asarray(f.to_image(), np.int16) for f in container.decode(video=0)]

    return [(int(np.abs(x - y).max()), float(np.abs(x - y).mean())) for x, y in zip(frames(a), frames(b), strict=True)]


def test_tiny_wan_long_video_in_segments_on_the_real_runtime(stack, api):
    from genserver.metrics import merged_counts

    merged_before = merged_counts()
    body = {"model": "tiny-wan", "prompt": "waves in segments", "seed": 5, "steps": 4}
    long_id = submit(api, num_frames=25, **body).json()["id"]  # 9 + 9 + 7 (of 9)
    job = finished(long_id)
    assert job.status == "succeeded", job.error
    data = api.get(f"/api/v1/jobs/{long_id}/").json()
    assert data["segment_count"] == 3 and [s["frames"] for s in data["segments"]] == [9, 9, 7]
    clips = [download(api, s["url"]) for s in data["segments"]]
    assert [frame_count(c) for c in clips] == [9, 9, 7]
    with av.open(io.BytesIO(download(api, data["outputs"][0]["url"]))) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 25 and (frames[0].width, frames[0].height) == (64, 64)
    # Segment 0 is exactly the 9-frame video of the same seed: a segment is an ordinary request.
    short = finished(submit(api, num_frames=9, **body).json()["id"])
    assert short.status == "succeeded"
    # Neither job ran in a merged batch (a merged row is only within one level of 255 of a lone run,
    # docs/ARCHITECTURE.md); the stack fixture leaves no other job in flight.
    assert merged_counts() == merged_before, "a job of this test was merged with another"
    alone = download(api, api.get(f"/api/v1/jobs/{short.pk}/").json()["outputs"][0]["url"])
    # The same bytes, not only the same pictures: the MP4 writer caps x264 where its AVX-512 code made the same
    # frames encode differently from one encode to the next (tests/runtime/test_video.py).
    assert alone == clips[0], f"segment 0 is not the lone 9-frame job: {pixel_differences(alone, clips[0])}"
    # Segment 1 has its own seed: every frame differs.
    assert all(largest for largest, _ in pixel_differences(clips[1], clips[0]))


def test_two_long_videos_of_one_shape_may_share_a_batch_and_keep_their_own_segments(stack, api):
    """tiny-wan merges same-shape jobs at the same step (max_merge): each keeps its own segment cursor."""
    body = {"model": "tiny-wan", "prompt": "merged in segments", "steps": 4, "num_frames": 17}  # 9 + 8 (of 9)
    ids = [submit(api, seed=seed, **body).json()["id"] for seed in (11, 12)]
    jobs = [finished(job_id) for job_id in ids]
    assert [j.status for j in jobs] == ["succeeded", "succeeded"], [j.error for j in jobs]
    clips = []
    for job_id in ids:
        data = api.get(f"/api/v1/jobs/{job_id}/").json()
        assert [s["frames"] for s in data["segments"]] == [9, 8] and data["progress"]["step"] == 8
        clips.append([download(api, s["url"]) for s in data["segments"]])
        assert frame_count(download(api, data["outputs"][0]["url"])) == 17
    assert clips[0][0] != clips[1][0] and clips[0][1] != clips[1][1]  # each job's own seeds
