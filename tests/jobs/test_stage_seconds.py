"""ETAs that include everything: the encode hop and the decode each model's jobs take, learned as they run
(services/estimates.py: learn_stage_seconds) and added by the queue picture (selectors/positions.py)."""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta

import pytest
from django.utils import timezone

from genserver.jobs import services
from genserver.jobs.models import Job, JobStatus
from genserver.jobs.selectors.positions import QueueSnapshot, stage_seconds
from genserver.jobs.services.estimates import STAGE_LEARN_STEP, _median_step
from genserver.redis_client import CORRECTION_KEY, STAGE_SECONDS_KEY, client as redis_client
from tests.conftest import submit

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("empty_broker")]

CARD, ENCODER, DECODER = "card0@test", "encode@test", "decode@test"


def _run_through(job_id: str, encode_took: float, decode_took: float) -> None:
    """Encode the job `encode_took` seconds after its encode message was published, denoise it, and finish
    its decode `decode_took` seconds after the decode was published (the rows' clocks moved back by hand)."""
    Job.objects.filter(pk=job_id).update(published_at=timezone.now() - timedelta(seconds=encode_took))
    assert services.start_encoding(job_id, ENCODER) is not None
    assert services.finish_encoding(job_id, ENCODER, f"embeddings/{job_id}")
    job = services.claim_chunk(job_id, CARD, 0)
    assert job is not None
    assert services.finish_chunk(job_id, CARD, job.total_steps, f"checkpoints/{job_id}", None)
    assert Job.objects.get(pk=job_id).status == JobStatus.DECODING
    Job.objects.filter(pk=job_id).update(published_at=timezone.now() - timedelta(seconds=decode_took))
    assert services.start_decoding(job_id, DECODER) is not None
    assert services.finish_decoding(job_id, DECODER, [])


def test_each_finished_job_teaches_its_models_encode_hop_and_decode(api):
    first, second = (submit(api, prompt=f"job {i}").json() for i in range(2))
    assert stage_seconds() == {}
    _run_through(first["id"], encode_took=3.0, decode_took=2.0)
    learned = stage_seconds()
    model = first["model"]
    assert learned[f"{model}:lead-in"] == pytest.approx(3.0, abs=0.5)  # the first measurement sets it
    assert learned[f"{model}:tail"] == pytest.approx(2.0, abs=0.5)
    _run_through(second["id"], encode_took=13.0, decode_took=12.0)
    again = stage_seconds()
    # A median, not a mean: one slow job moves it one step up (a slow decode behind a video's), not a fifth
    # of the way to its 13 s.
    assert again[f"{model}:lead-in"] == pytest.approx(learned[f"{model}:lead-in"] * (1 + STAGE_LEARN_STEP))
    assert again[f"{model}:tail"] == pytest.approx(learned[f"{model}:tail"] * (1 + STAGE_LEARN_STEP))


def test_an_eta_adds_the_encode_hop_still_ahead_and_the_decode_after_denoising(api):
    body = submit(api).json()
    job = Job.objects.get(pk=body["id"])
    snapshot = dataclasses.replace(QueueSnapshot.load(), taken_at=job.published_at)  # the moment it was published
    without = snapshot.eta_seconds(job)
    start_without, _ = snapshot.quote(job)
    assert without is not None and start_without is not None
    model, chunks = job.model, math.ceil(job.total_steps / job.chunk_steps)
    redis_client().hset(
        STAGE_SECONDS_KEY,
        mapping={f"{model}:lead-in": 5.0, f"{model}:hop": 0.5, f"{model}:boundary": 0.25, f"{model}:tail": 2.0},
    )
    snapshot = dataclasses.replace(snapshot)  # a new snapshot reads the learned seconds again
    after = chunks * 0.25 + 2.0  # its chunks' boundaries, then its decode
    assert snapshot.eta_seconds(job) == pytest.approx(without + 5.0 + 0.5 + after, abs=1e-3)
    start, finish = snapshot.quote(job)
    assert (start - start_without).total_seconds() == pytest.approx(5.5, abs=1e-3)  # its first step: after both hops
    assert (finish - snapshot.taken_at).total_seconds() == pytest.approx(without + 5.5 + after, abs=1e-3)
    # Encoded: the encode hop is behind it; the dispatch hop, the boundaries and the decode are still ahead.
    assert services.start_encoding(job.pk, ENCODER) is not None
    assert services.finish_encoding(job.pk, ENCODER, f"embeddings/{job.pk}")
    encoded = Job.objects.get(pk=job.pk)
    assert dataclasses.replace(snapshot).eta_seconds(encoded) == pytest.approx(without + 0.5 + after, abs=1e-3)


def test_a_decoding_job_is_due_when_its_models_decode_has_run(api):
    body = submit(api).json()
    redis_client().hset(STAGE_SECONDS_KEY, mapping={f"{body['model']}:tail": 2.0})
    job_id = body["id"]
    assert services.start_encoding(job_id, ENCODER) is not None
    assert services.finish_encoding(job_id, ENCODER, f"embeddings/{job_id}")
    job = services.claim_chunk(job_id, CARD, 0)
    assert services.finish_chunk(job_id, CARD, job.total_steps, f"checkpoints/{job_id}", None)
    decoding = Job.objects.get(pk=job_id)
    snapshot = QueueSnapshot.load()
    at = dataclasses.replace(snapshot, taken_at=decoding.published_at + timedelta(seconds=0.5))
    assert at.eta_seconds(decoding) == pytest.approx(1.5, abs=1e-3)
    late = dataclasses.replace(snapshot, taken_at=decoding.published_at + timedelta(seconds=5))
    assert late.eta_seconds(decoding) == 0.0  # overdue: any moment now, never negative


def test_with_nothing_learned_an_eta_is_the_queue_and_the_denoising(api):
    body = submit(api).json()
    job = Job.objects.get(pk=body["id"])
    snapshot = dataclasses.replace(QueueSnapshot.load(), taken_at=job.published_at)
    wait, own = snapshot._wait_and_own(job)
    assert own == pytest.approx(job.remaining_seconds * job.clock_scale)
    assert snapshot.eta_seconds(job) == pytest.approx(wait + own, abs=1e-3)


def test_a_running_chunk_holds_its_card_for_what_is_left_of_it(api):
    """The one card (tests/settings.py) runs a video's chunk: an image waits for the chunk's rest, counted from
    when the chunk began, not for the whole chunk (a one-step chunk reports no step until it ends). Past its
    length the chunk is at its boundary, and the card has kept the video for its next chunk."""
    video_id = submit(api, model="wan-sim").json()["id"]
    assert services.start_encoding(video_id, ENCODER) is not None
    assert services.finish_encoding(video_id, ENCODER, f"embeddings/{video_id}")
    video = services.claim_chunk(video_id, CARD, 0)
    assert video is not None and video.chunk_started_at is not None
    chunk_wall = video.chunk_steps * video.estimated_seconds / video.total_steps * video.clock_scale
    image = Job.objects.get(pk=submit(api).json()["id"])
    snapshot = QueueSnapshot.load()

    def wait_at(seconds_into_the_chunk: float) -> float:
        at = dataclasses.replace(snapshot, taken_at=video.chunk_started_at + timedelta(seconds=seconds_into_the_chunk))
        return at._wait_and_own(image)[0]

    assert wait_at(0) - wait_at(chunk_wall / 4) == pytest.approx(chunk_wall / 4, rel=1e-3)
    assert wait_at(chunk_wall * 1.01) == pytest.approx(wait_at(0), rel=1e-3)  # at its boundary: the next chunk
    # A boundary where the card keeps the job starts the next chunk's clock.
    assert services.finish_chunk(video_id, CARD, video.chunk_steps, f"checkpoints/{video_id}", None, keep_lease=True)
    assert Job.objects.get(pk=video_id).chunk_started_at > video.chunk_started_at


def test_the_learned_stage_seconds_settle_on_the_median_of_what_the_jobs_took():
    learned = 1.0
    for took in [0.1, 0.12, 0.1, 3.0, 0.11, 0.1, 2.5, 0.12] * 20:  # mostly 0.1 s, a quarter of them slow
        learned = _median_step(learned, took)
    assert 0.09 <= learned <= 0.14  # the mean is 0.78 s
    assert _median_step(0.5, 0.5) == 0.5
    assert _median_step(0.0, 0.2) == pytest.approx(1e-3 * (1 + STAGE_LEARN_STEP))  # a zero can step up again
    assert _median_step(1.0, 1.05) == 1.05  # never past what it measured


def _to_decoding(job_id: str) -> Job:
    assert services.start_encoding(job_id, ENCODER) is not None
    assert services.finish_encoding(job_id, ENCODER, f"embeddings/{job_id}")
    job = services.claim_chunk(job_id, CARD, 0)
    assert job is not None
    assert services.finish_chunk(job_id, CARD, job.total_steps, f"checkpoints/{job_id}", None)
    return Job.objects.get(pk=job_id)


def test_a_decode_teaches_its_model_the_decode_alone_besides_the_tail(api):
    job_id = submit(api).json()["id"]
    decoding = _to_decoding(job_id)
    Job.objects.filter(pk=job_id).update(published_at=timezone.now() - timedelta(seconds=3.0))  # its decode's publish
    assert services.start_decoding(job_id, DECODER) is not None
    Job.objects.filter(pk=job_id).update(chunk_started_at=timezone.now() - timedelta(seconds=1.0))  # took it 1 s ago
    assert services.finish_decoding(job_id, DECODER, [])
    learned = stage_seconds()
    assert learned[f"{decoding.model}:tail"] == pytest.approx(3.0, abs=0.5)  # publish → done: the wait included
    assert learned[f"{decoding.model}:decode"] == pytest.approx(1.0, abs=0.5)  # the decode worker's own part


def test_an_eta_waits_for_the_decode_worker_behind_a_long_decode(api):
    """One decode worker (tests/settings.py) holds a 10-s decode: a job whose denoising ends before that waits for
    it, then takes its own decode; with the worker free it counts its decode hop and decode alone."""
    model = submit(api).json()["model"]
    redis_client().hset(STAGE_SECONDS_KEY, mapping={f"{model}:tail": 10.5, f"{model}:decode": 10.0})  # hop: 0.5 s
    first = _to_decoding(submit(api).json()["id"])
    image = Job.objects.get(pk=submit(api).json()["id"])
    # The first job's decode is just published, not yet taken: a worker takes it after its hop, for 10 s.
    queued = dataclasses.replace(QueueSnapshot.load(), taken_at=first.published_at)
    denoised_in = queued._wait_and_own(image)[0] + queued._denoise_left(image)
    assert denoised_in + 0.5 < 10.0, "the image's denoising must end within the other decode for this test"
    assert queued.eta_seconds(image) == pytest.approx(0.5 + 10.0 + 10.0, abs=1e-3)  # hop, the other's, its own
    # Taken 4 s ago: 6 s of it left, and the image's decode starts when it ends.
    assert services.start_decoding(first.pk, DECODER) is not None
    taken = Job.objects.get(pk=first.pk).chunk_started_at
    busy = dataclasses.replace(QueueSnapshot.load(), taken_at=taken + timedelta(seconds=4))
    assert busy.eta_seconds(image) == pytest.approx(max(6.0, denoised_in + 0.5) + 10.0, abs=1e-3)
    assert busy.eta_seconds(first) == pytest.approx(6.0, abs=1e-3)  # in service: what is left of its decode
    # Done: the worker is free, and the image counts its hop and its own decode after its denoising.
    assert services.finish_decoding(first.pk, DECODER, [])
    redis_client().hset(STAGE_SECONDS_KEY, mapping={f"{model}:tail": 10.5, f"{model}:decode": 10.0})  # as before
    done = dataclasses.replace(QueueSnapshot.load(), taken_at=image.published_at)
    assert done.eta_seconds(image) == pytest.approx(denoised_in + 10.5, abs=1e-3)


def test_a_simulated_models_steps_teach_it_their_overhead_and_an_eta_counts_it_for_every_step_left(api):
    """A simulated model never corrects its cost model (its sleep is the cost model), but each of its steps also
    pays the service's own work per step: learned as STEP from every recorded chunk's measured step time, and
    counted by an ETA for every step left, its own and those of a running chunk the card has not measured yet."""
    video = Job.objects.get(pk=submit(api, model="wan-sim").json()["id"])
    image = Job.objects.get(pk=submit(api).json()["id"])
    snapshot = dataclasses.replace(QueueSnapshot.load(), taken_at=image.published_at)
    _, own_before = snapshot._wait_and_own(image)

    def step_wall(job: Job) -> float:
        return job.estimated_seconds / job.total_steps * job.clock_scale

    services.learn_from_chunk(image, step_wall(image) + 0.004, CARD)
    assert stage_seconds()[f"{image.model}:step"] == pytest.approx(0.004)
    services.learn_from_chunk(image, step_wall(image) - 0.001, CARD)  # a step faster than modelled teaches 0
    assert stage_seconds()[f"{image.model}:step"] == pytest.approx(0.004 * (1 - STAGE_LEARN_STEP))
    assert not redis_client().exists(CORRECTION_KEY)  # its cost model stays as it is
    _, own = dataclasses.replace(snapshot)._wait_and_own(image)
    assert own - own_before == pytest.approx(image.total_steps * 0.004 * (1 - STAGE_LEARN_STEP), rel=1e-6)

    # The one card runs the video's chunk, not yet measured: the image behind it waits for the chunk's steps
    # at the video's learned overhead as well.
    assert services.start_encoding(video.pk, ENCODER) is not None
    assert services.finish_encoding(video.pk, ENCODER, f"embeddings/{video.pk}")
    running = services.claim_chunk(video.pk, CARD, 0)
    assert running is not None
    at_start = dataclasses.replace(QueueSnapshot.load(), taken_at=running.chunk_started_at)
    wait_before, _ = at_start._wait_and_own(image)
    redis_client().hset(STAGE_SECONDS_KEY, f"{video.model}:step", 0.05)
    wait, _ = dataclasses.replace(at_start)._wait_and_own(image)
    assert wait - wait_before == pytest.approx(running.chunk_steps * 0.05, rel=1e-6)
