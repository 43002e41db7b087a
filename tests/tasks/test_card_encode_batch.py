"""A merged batch of a model that encodes on its card (tiny-sd-card: `encode_on_card`, `max_merge` 4), run here as a
worker runs it (real storage, database and Redis; messages captured): its new prompts go through one text-encoder
call, each stored under its job's key, and every member denoises to its decode."""

from __future__ import annotations

import time

import pytest

from genserver.jobs import services
from genserver.jobs.models import Job, JobStatus
from genserver.metrics import embedding_cache_counts
from genserver.storage import default_storage
from tests.support.broker import capture_sends
from tests.support.encoders import encoder_calls
from tests.support.waits import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_merged_batch_encodes_its_new_prompts_in_one_call(make_user, monkeypatch):
    from tasks import denoise
    from workers.runtime.unet import UNetFamily

    calls = encoder_calls(monkeypatch, UNetFamily)
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    before = embedding_cache_counts()
    shape = {"model": "tiny-sd-card", "width": 64, "height": 64, "num_frames": 1, "steps": 2, "guidance_scale": 5.0}
    shape["num_outputs"] = 1
    jobs = [
        services.submit_job(make_user(f"merged-{i}").user, shape | {"prompt": f"merged {i} {time.time()}", "seed": i})
        for i in range(3)  # three users: no fair window holds any of them back
    ]
    assert [j.status for j in jobs] == [JobStatus.DENOISING] * 3 and not any(s[0] == "encode" for s in sent)
    assert not any(default_storage().exists(j.embeddings_key) for j in jobs)

    denoise.run_chunk.apply(args=[str(jobs[0].pk), 0]).get()
    assert calls == [3]  # one call for the batch, none in the members' loads
    rows = [Job.objects.get(pk=j.pk) for j in jobs]
    assert [r.status for r in rows] == [JobStatus.DECODING] * 3, [r.error for r in rows]
    assert all(default_storage().exists(r.embeddings_key) for r in rows)
    wait_for(lambda: embedding_cache_counts()["misses"] - before["misses"] == 3, 10, what="the card's 3 misses counted")


def test_a_full_disk_under_the_cards_embeddings_write_fails_the_job_at_once(make_user, monkeypatch):
    """The write runs beside the first steps; the chunk's end waits for it, so its error is the attempt's: a full
    disk fails the job at once with the storage-full error (docs/RELIABILITY.md), nothing recorded past step 0."""
    from genserver.storage import LocalStorage, StorageError
    from tasks import denoise

    put = LocalStorage.put

    def full_for_embeddings(self, key, data):
        if key.startswith("embeddings/"):
            raise StorageError(f"could not write {key!r} under {self.root}: No space left on device")
        return put(self, key, data)

    monkeypatch.setattr(LocalStorage, "put", full_for_embeddings)
    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    request = {"model": "tiny-sd-card", "width": 64, "height": 64, "num_frames": 1, "steps": 2, "guidance_scale": 5.0}
    job = services.submit_job(
        make_user("full").user, request | {"num_outputs": 1, "seed": 1, "prompt": f"full {time.time()}"}
    )
    denoise.run_chunk.apply(args=[str(job.pk), 0]).get()
    row = Job.objects.get(pk=job.pk)
    assert row.status == JobStatus.FAILED and row.error.startswith("storage full"), row.error
    assert row.checkpoint_step == 0 and not default_storage().exists(row.embeddings_key)
