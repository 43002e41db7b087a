"""On the real stack, on each storage backend: a worker's files live in the chosen store, and retention
(run here as beat runs it) clears them there. The stack's workers inherit the backend's variables."""
from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from genserver.jobs import services
from genserver.storage import default_storage
from tests.support.api import submit
from tests.support.waits import finished

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]


def test_a_jobs_files_live_in_the_store_and_retention_clears_them(storage_backend, stack, api, settings):
    settings.OUTPUT_TTL_SECONDS = settings.EMBEDDINGS_TTL_SECONDS = 60
    response = submit(api, model="tiny-sd", prompt=f"kept then expired {uuid.uuid4().hex}", steps=4,
                      preview_every=2)
    assert response.status_code == 201, response.content
    job = finished(response.json()["id"])
    assert job.status == "succeeded", job.error
    storage = default_storage()
    written = [job.embeddings_key, job.preview_key, *(out["key"] for out in job.outputs)]
    assert all(storage.exists(key) for key in written), written
    output_url = api.get(f"/api/v1/jobs/{job.pk}/").json()["outputs"][0]["url"]
    assert b"".join(api.get(output_url).streaming_content).startswith(b"\x89PNG")

    swept = services.retain(timezone.now() + timedelta(hours=1))
    assert swept["outputs_expired"] >= 1 and swept["embeddings_deleted"] >= 1, swept
    assert not any(storage.exists(key) for key in written)
    assert api.get(output_url).status_code == 404
