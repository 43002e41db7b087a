"""The online step-time correction: learned from measured chunks, per model and shape bucket, bounded, used by
the estimates, and shown on GET /api/v1/models/ (real Redis and PostgreSQL, no workers)."""

from __future__ import annotations

import pytest

from genserver.jobs import services
from genserver.jobs.models import Job
from genserver.redis_client import CORRECTION_KEY, client as redis_client
from genserver.scheduling.cost import StepTimeCorrection
from tests.conftest import submit

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "card0@test:1"


@pytest.fixture(autouse=True)
def _no_learned_factors():
    redis_client().delete(CORRECTION_KEY)
    yield
    redis_client().delete(CORRECTION_KEY)


def request_of(job: Job) -> dict:
    return {
        "model": job.model,
        "width": job.width,
        "height": job.height,
        "num_frames": job.num_frames,
        "steps": job.steps,
        "guidance_scale": job.guidance_scale,
        "num_outputs": job.num_outputs,
    }


def run_measured_chunk(job_id: str, step_seconds: float) -> None:
    """What a card reports at a chunk boundary: its chunk's measured step time (the job service learns from it)."""
    job = Job.objects.get(pk=job_id)
    if job.status == "queued":
        assert services.start_encoding(job_id, "encode@test:1") is not None
        assert services.finish_encoding(job_id, "encode@test:1", "embeddings/x")
        job.refresh_from_db()
    assert services.claim_chunk(job_id, WORKER, job.checkpoint_step) is not None
    step = job.checkpoint_step + 1  # a one-step chunk: a job of 8 steps reports up to 8 of them
    assert services.finish_chunk(job_id, WORKER, step, f"checkpoints/{job_id}/{step}", step_seconds)


def test_the_factor_is_an_ewma_bounded_per_observation_and_overall():
    c = StepTimeCorrection(alpha=0.2, max_jump=4.0, limits=(0.01, 100.0))
    assert c.factor("m", "unet:4") == 1.0  # nothing learned: the cost model as it is
    assert c.observe("m", "unet:4", 0.010, 0.020) == pytest.approx(2.0)  # the first measurement sets it
    assert c.observe("m", "unet:4", 0.010, 0.030) == pytest.approx(0.8 * 2.0 + 0.2 * 3.0)
    # One outlier (a 1,000× slower chunk) counts as at most max_jump × the factor it updates.
    before = c.factor("m", "unet:4")
    assert c.observe("m", "unet:4", 0.010, 10.0) == pytest.approx(0.8 * before + 0.2 * 4.0 * before)
    assert c.observe("m", "unet:4", 0.0, 1.0) == c.factor("m", "unet:4")  # nothing to learn from
    assert c.observe("m", "unet:4", 1.0, 0.0) == c.factor("m", "unet:4")
    # Per model and per bucket: the others stay where they were.
    assert c.factor("m", "unet:8") == 1.0 and c.factor("other", "unet:4") == 1.0
    # Overall limits: a first measurement far outside them is held at the limit.
    assert c.observe("m", "unet:10", 1.0, 1e6) == 100.0 and c.observe("n", "unet:4", 1.0, 1e-9) == 0.01
    assert StepTimeCorrection.split(StepTimeCorrection.key("tiny-sd", "unet:4")) == ("tiny-sd", "unet:4")


def test_a_measured_chunk_corrects_the_estimates_of_its_model_and_shape_only(api):
    small = submit(api, model="tiny-sd", prompt="a fox", width=64, height=64, steps=8).json()
    job = Job.objects.get(pk=small["id"])
    data = request_of(job)
    modelled = services.estimate(data).seconds
    assert job.estimated_seconds == pytest.approx(modelled)
    large = data | {"width": 256, "height": 256}
    large_before = services.estimate(large).seconds
    other_model = {**data, "model": "tiny-sdxl"}
    other_before = services.estimate(other_model).seconds

    run_measured_chunk(small["id"], 2.0 * modelled / job.steps)  # twice as slow as modelled
    assert services.estimate(data).seconds == pytest.approx(2.0 * modelled)
    assert services.estimate(large).seconds == pytest.approx(large_before)  # another shape bucket
    assert services.estimate(other_model).seconds == pytest.approx(other_before)  # another model

    run_measured_chunk(small["id"], 3.0 * modelled / job.steps)  # later chunks move it as an EWMA
    assert services.estimate(data).seconds == pytest.approx((0.8 * 2.0 + 0.2 * 3.0) * modelled)


def test_one_outlier_chunk_moves_the_factor_a_bounded_amount(api):
    job_id = submit(api, model="tiny-sd", prompt="a fox", width=64, height=64, steps=8).json()["id"]
    job = Job.objects.get(pk=job_id)
    modelled_step = services.estimate(request_of(job)).seconds / job.steps
    run_measured_chunk(job_id, modelled_step)  # as modelled: factor 1
    run_measured_chunk(job_id, 500 * modelled_step)  # a stalled card
    factor = services.estimate(request_of(job)).seconds / (modelled_step * job.steps)
    assert factor == pytest.approx(0.8 + 0.2 * StepTimeCorrection.max_jump)


def test_simulated_models_never_learn(api):
    job_id = submit(api, model="sdxl-sim", prompt="a fox").json()["id"]
    run_measured_chunk(job_id, 10.0)
    assert not redis_client().exists(CORRECTION_KEY)


def test_the_models_endpoint_shows_each_models_learned_factors(api):
    before = {m["name"]: m for m in api.get("/api/v1/models/").json()}
    assert all(m["step_time_correction"] == {} for m in before.values())
    job_id = submit(api, model="tiny-sd", prompt="a fox", width=64, height=64, steps=8).json()["id"]
    job = Job.objects.get(pk=job_id)
    run_measured_chunk(job_id, 1.5 * services.estimate(request_of(job)).seconds / job.steps)
    models = {m["name"]: m for m in api.get("/api/v1/models/").json()}
    (bucket, factor), *more = models["tiny-sd"]["step_time_correction"].items()
    assert not more and bucket.startswith("unet:") and factor == pytest.approx(1.5, rel=1e-3)
    assert all(m["step_time_correction"] == {} for name, m in models.items() if name != "tiny-sd")
