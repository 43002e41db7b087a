"""The real diffusion runtime through the whole stack: every family, previews, the prompt cache, batching."""

from __future__ import annotations

import io
import uuid

import av
import numpy as np
import pytest
from PIL import Image

from genserver.metrics import embedding_cache_counts
from tests.support.api import download, submit
from tests.support.waits import finished, job_row, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]


@pytest.mark.parametrize("model", ["tiny-sdxl", "tiny-sd-dpm", "tiny-flux", "tiny-flux-dpm"])
def test_image_family_job_succeeds_with_pngs(stack, api, model):
    job_id = submit(api, model=model, prompt="a red fox", num_outputs=2, steps=4).json()["id"]
    job = finished(job_id)
    assert job.status == "succeeded", job.error
    outputs = api.get(f"/api/v1/jobs/{job_id}/").json()["outputs"]
    assert [o["content_type"] for o in outputs] == ["image/png", "image/png"]
    image = Image.open(io.BytesIO(download(api, outputs[1]["url"])))
    assert image.size == (job.width, job.height)


def test_video_family_job_succeeds_with_an_mp4_and_a_poster(stack, api):
    job_id = submit(api, model="tiny-wan", prompt="waves", num_frames=9, steps=3).json()["id"]
    job = finished(job_id)
    assert job.status == "succeeded", job.error
    outputs = api.get(f"/api/v1/jobs/{job_id}/").json()["outputs"]
    assert [o["content_type"] for o in outputs] == ["video/mp4", "image/png"]
    with av.open(io.BytesIO(download(api, outputs[0]["url"]))) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 9 and (frames[0].width, frames[0].height) == (job.width, job.height)
    assert download(api, outputs[1]["url"]).startswith(b"\x89PNG")


def test_preview_appears_before_the_job_finishes(stack, api):
    job_id = submit(api, model="tiny-sd", prompt="a slow one", steps=50, preview_every=1, width=256, height=256).json()[
        "id"
    ]
    seen = wait_for(lambda: (j := job_row(job_id)).preview_key and j, 60, what="a preview")
    assert not seen.is_terminal and 1 <= seen.preview_step < seen.steps
    body = api.get(f"/api/v1/jobs/{job_id}/").json()
    assert body["preview_url"] and download(api, body["preview_url"]).startswith(b"\x89PNG")
    assert finished(job_id).status == "succeeded"


def test_repeated_prompt_hits_the_embedding_cache(stack, api):
    """The first job encodes; the same prompt again (another seed, then the first seed) skips the encode
    worker: recorded `denoising` with the first one's embeddings, it succeeds, and at the first seed its
    pixels are the first one's."""
    prompt = f"a cached lighthouse {uuid.uuid4()}"
    before = embedding_cache_counts()
    first = submit(api, model="tiny-sd", prompt=prompt, steps=2, seed=3).json()["id"]
    assert finished(first).status == "succeeded"
    again = [submit(api, model="tiny-sd", prompt=prompt, steps=2, seed=seed).json() for seed in (7, 3)]
    assert [body["status"] for body in again] == ["denoising", "denoising"]  # never queued for encode
    jobs = [finished(body["id"]) for body in again]
    assert [job.status for job in jobs] == ["succeeded", "succeeded"], [job.error for job in jobs]
    after = embedding_cache_counts()
    # The encode worker counts each lookup it makes: had it seen either job, there would be more hits.
    assert after["misses"] - before["misses"] == 1 and after["hits"] - before["hits"] == 2
    assert job_row(first).embeddings_key == jobs[0].embeddings_key == jobs[1].embeddings_key

    def pixels(job_id: str) -> np.ndarray:
        url = api.get(f"/api/v1/jobs/{job_id}/").json()["outputs"][0]["url"]
        return np.asarray(Image.open(io.BytesIO(download(api, url))), np.int16)

    # Within one level of 255, not bit-equal: a UNet job restored from a checkpoint (a yield or a kill
    # between its chunks) is within 1e-6 of one that ran straight through, not equal (exact_resume=False in
    # tests/runtime/families.py), and which of the two a job gets depends on the stack's timing. A full run
    # saw one pixel one level apart after the chaos drill.
    assert np.abs(pixels(str(jobs[1].pk)) - pixels(first)).max() <= 1
    assert np.abs(pixels(str(jobs[0].pk)) - pixels(first)).max() > 1  # another seed: another picture


def test_a_model_that_encodes_on_its_card_never_queues_a_new_prompt_for_encode(stack, api):
    """tiny-sd-card (tiny-sd's weights, `encode_on_card`): a new prompt is recorded `denoising` at submit, its
    card encodes it (a miss, counted once) and stores it, the same prompt again is a hit, and the picture is
    tiny-sd's through the encode worker."""
    prompt = f"encoded on the card {uuid.uuid4()}"
    before = embedding_cache_counts()
    bodies = [submit(api, model="tiny-sd-card", prompt=prompt, steps=2, seed=3).json()]
    assert bodies[0]["status"] == "denoising"  # never queued for the encode worker
    assert finished(bodies[0]["id"]).status == "succeeded", job_row(bodies[0]["id"]).error
    bodies.append(submit(api, model="tiny-sd-card", prompt=prompt, steps=2, seed=3).json())
    through_encode = submit(api, model="tiny-sd", prompt=prompt, steps=2, seed=3).json()
    assert through_encode["status"] == "queued"
    jobs = [finished(body["id"]) for body in (*bodies[1:], through_encode)]
    assert [job.status for job in jobs] == ["succeeded", "succeeded"], [job.error for job in jobs]

    # The card counts its miss off its path (a background thread): waited for, as the encode worker's.
    def misses() -> int:
        return embedding_cache_counts()["misses"] - before["misses"]

    def hits() -> int:
        return embedding_cache_counts()["hits"] - before["hits"]

    wait_for(lambda: misses() >= 2 and hits() >= 1, 30, what="the lookups counted (the card's, the encode worker's)")
    after = embedding_cache_counts()
    assert after["misses"] - before["misses"] == 2 and after["hits"] - before["hits"] == 1
    assert job_row(bodies[0]["id"]).embeddings_key == jobs[0].embeddings_key != jobs[1].embeddings_key

    def pixels(job_id: str) -> np.ndarray:
        url = api.get(f"/api/v1/jobs/{job_id}/").json()["outputs"][0]["url"]
        return np.asarray(Image.open(io.BytesIO(download(api, url))), np.int16)

    # Within one level, as test_repeated_prompt_hits_the_embedding_cache says why.
    assert np.abs(pixels(bodies[0]["id"]) - pixels(through_encode["id"])).max() <= 1
    assert np.abs(pixels(bodies[1]["id"]) - pixels(through_encode["id"])).max() <= 1


def test_cancelling_a_real_model_during_denoise_skips_decode(stack, api):
    job_id = submit(api, model="tiny-sd", prompt="cancel me", steps=50, width=256, height=256).json()["id"]
    wait_for(lambda: job_row(job_id).steps_done >= 1, 60, what="denoising to start")
    api.post(f"/api/v1/jobs/{job_id}/cancel/")
    job = finished(job_id, timeout=30)
    assert job.status == "cancelled" and not job.outputs and job.steps_done < job.steps


def test_workers_endpoint_shows_loaded_models(stack, api, staff_api):
    assert finished(submit(api, model="tiny-sd", prompt="load me", steps=2).json()["id"]).status == "succeeded"

    def card_holds_tiny_sd():
        workers = {w["name"]: w for w in staff_api.get("/api/v1/workers/").json()["workers"]}
        return "tiny-sd" in workers.get(stack.hostname("card0"), {}).get("models", [])

    wait_for(card_holds_tiny_sd, 15, what="card0's heartbeat to list tiny-sd")


@pytest.mark.parametrize(
    "model, fields",
    [
        ("tiny-sd-dpm", {"width": 256, "height": 256, "steps": 40}),
        ("tiny-flux-dpm", {"width": 256, "height": 256, "steps": 40}),
        ("tiny-wan", {"width": 128, "height": 128, "num_frames": 17, "steps": 40}),
    ],
)
def test_job_resumed_after_a_worker_kill_ends_exactly_as_an_uninterrupted_one(stack, api, model, fields):
    """The multistep solver's history, the RNG and the latents all travel in the checkpoint."""
    body = {"model": model, "prompt": "exact resume", "seed": 1234} | fields
    killed = submit(api, **body).json()["id"]
    wait_for(lambda: job_row(killed).checkpoint_step >= 5, 90, what="five checkpointed steps")
    stack.kill("card0")
    at_kill = job_row(killed)
    stack.wait_ready()
    job = finished(killed)
    assert job.status == "succeeded", job.error
    assert 5 <= at_kill.checkpoint_step < job.steps and job.chunks_run > 1
    clean = finished(submit(api, **body).json()["id"])
    assert clean.status == "succeeded" and clean.attempts == 0
    first = [download(api, o["url"]) for o in api.get(f"/api/v1/jobs/{killed}/").json()["outputs"]]
    second = [download(api, o["url"]) for o in api.get(f"/api/v1/jobs/{clean.pk}/").json()["outputs"]]
    assert first == second, "the resumed job's outputs differ from an uninterrupted run's"
