"""Submit skips the encode hop when the prompt's embeddings are already stored: the first denoise chunk is
published at once, the row is what encode would have left, and the cache metric counts the hit (no workers)."""

from __future__ import annotations

import uuid

import pytest

from genserver import deployment
from genserver.jobs import broker, services
from genserver.jobs.models import Job, JobStage, JobStatus
from genserver.metrics import embedding_cache_counts
from genserver.redis_client import client as redis_client
from genserver.storage import default_storage, keys
from tests.conftest import submit
from tests.support.broker import BROKER_QUEUES
from workers.runtime import stages
from workers.runtime.simulated import SimulatedFamily

pytestmark = [
    pytest.mark.django_db(transaction=True),  # the service publishes on commit
    pytest.mark.usefixtures("empty_broker"),
]


def waiting(job_id: str) -> dict[str, list[str]]:
    """The broker messages that name the job: {queue: [task name, ...]}."""
    found: dict[str, list[str]] = {}
    r = redis_client()
    for queue in BROKER_QUEUES:
        for key in broker.queue_keys(queue):
            for raw in r.lrange(key, 0, -1):
                if job_id.encode() in raw:
                    task = broker.ENCODE_TASK if broker.ENCODE_TASK.name.encode() in raw else broker.CHUNK_TASK
                    assert task.name.encode() in raw, raw[:200]
                    found.setdefault(queue, []).append(task.name)
    return found


def store_embeddings(model: str, prompt: str, negative: str = "") -> str:
    spec = deployment.registry().get(model)
    key = keys.embeddings_key(keys.encoder_identity(spec.family, spec.name), prompt, negative)
    default_storage().put(key, b"embeddings")
    return key


def test_the_api_computes_the_key_the_runtime_stores_under(tmp_path):
    spec = deployment.registry().get("sdxl-sim")
    family = SimulatedFamily(spec, "cpu", tmp_path)
    api_side = keys.embeddings_key(keys.encoder_identity(spec.family, spec.name), "a fox", "blurry")
    assert stages.embeddings_key(family, "a fox", "blurry") == api_side
    # Each part of the key matters: the encoder, the prompt and the negative prompt.
    variants = {
        keys.embeddings_key("sdxl:sdxl-sim", "a fox", "blurry"),
        keys.embeddings_key("sdxl:other", "a fox", "blurry"),
        keys.embeddings_key("sdxl:sdxl-sim", "a fox", ""),
        keys.embeddings_key("sdxl:sdxl-sim", "a fix", "blurry"),
    }
    assert len(variants) == 4


def test_a_miss_publishes_the_encode_and_counts_nothing_at_submit(api):
    prompt = f"never seen {uuid.uuid4()}"
    before = embedding_cache_counts()
    body = submit(api, prompt=prompt).json()
    job = Job.objects.get(pk=body["id"])
    assert (body["status"], job.status, job.stage, job.embeddings_key) == ("queued", "queued", "queued", "")
    assert waiting(body["id"]) == {"encode": [broker.ENCODE_TASK.name]}
    assert embedding_cache_counts() == before  # the encode worker counts its own lookup


def test_a_hit_publishes_the_first_chunk_and_never_the_encode(api):
    prompt = f"seen before {uuid.uuid4()}"
    key = store_embeddings("sdxl-sim", prompt, "low quality")
    before = embedding_cache_counts()
    body = submit(api, prompt=prompt, negative_prompt="low quality").json()
    job = Job.objects.get(pk=body["id"])
    assert (job.status, job.stage, job.embeddings_key, job.checkpoint_step) == (
        JobStatus.DENOISING,
        JobStage.WAITING,
        key,
        0,
    )
    assert body["status"] == "denoising" and body["stage"] == "waiting"
    assert waiting(body["id"]) == {job.queue: [broker.CHUNK_TASK.name]}
    after = embedding_cache_counts()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (1, 0)
    # The chunk message finds the job ready for its first step: the claim the denoise task makes takes it.
    claimed = services.claim_chunk(body["id"], "card0@test:1", 0)
    assert claimed is not None and claimed.stage == JobStage.DENOISING
    # The encode message a reaper would never send is not needed: the encode stage refuses it.
    assert services.start_encoding(body["id"], "encode@test:1") is None


def test_the_same_prompt_under_another_negative_prompt_or_model_is_a_miss(api):
    prompt = f"half seen {uuid.uuid4()}"
    store_embeddings("sdxl-sim", prompt)
    other_negative = submit(api, prompt=prompt, negative_prompt="blurry").json()
    other_model = submit(api, model="wan-sim", prompt=prompt).json()
    assert waiting(other_negative["id"]) == {"encode": [broker.ENCODE_TASK.name]}
    assert waiting(other_model["id"]) == {"encode": [broker.ENCODE_TASK.name]}


def test_a_cancelled_hit_ends_at_once_and_its_chunk_does_nothing(api):
    prompt = f"cancel a hit {uuid.uuid4()}"
    store_embeddings("sdxl-sim", prompt)
    job_id = submit(api, prompt=prompt).json()["id"]
    assert api.post(f"/api/v1/jobs/{job_id}/cancel/").status_code in (200, 202)
    assert Job.objects.get(pk=job_id).status == JobStatus.CANCELLED
    assert services.claim_chunk(job_id, "card0@test:1", 0) is None


def test_a_miss_of_a_model_that_encodes_on_its_card_publishes_the_first_chunk_with_the_key_to_store(api):
    """sdxl-turbo-sim has `encode_on_card`: its new prompt skips the encode worker like a hit, recorded with the
    key its card stores the embeddings under, with no lookup at submit and nothing counted there (its card reads
    the key, encodes only when it finds nothing, and counts the lookup)."""
    spec = deployment.registry().get("sdxl-turbo-sim")
    assert spec.encode_on_card
    prompt = f"encoded by the card {uuid.uuid4()}"
    before = embedding_cache_counts()
    body = submit(api, model=spec.name, prompt=prompt).json()
    job = Job.objects.get(pk=body["id"])
    key = keys.embeddings_key(keys.encoder_identity(spec.family, spec.name), prompt, "")
    assert (job.status, job.stage, job.embeddings_key) == (JobStatus.DENOISING, JobStage.WAITING, key)
    assert not default_storage().exists(key)  # the card writes it before its first step
    assert waiting(body["id"]) == {job.queue: [broker.CHUNK_TASK.name]}
    assert embedding_cache_counts() == before
    store_embeddings(spec.name, prompt)  # stored now: the same prompt's job is recorded the same way
    again = Job.objects.get(pk=submit(api, model=spec.name, prompt=prompt).json()["id"])
    assert (again.status, again.embeddings_key) == (JobStatus.DENOISING, key)
    assert embedding_cache_counts() == before
