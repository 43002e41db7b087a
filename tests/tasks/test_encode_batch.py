"""Prompts that wait together share one text-encoder call; each job still gets its own embeddings."""

from __future__ import annotations

import json

import pytest

from genserver.jobs.models import Job
from tasks.encode import encode
from tests.support.encoders import encoder_calls
from workers.runtime.simulated import SimulatedFamily

pytestmark = pytest.mark.django_db


def test_waiting_prompts_are_encoded_in_one_batch(api, monkeypatch):
    calls = encoder_calls(monkeypatch, SimulatedFamily)
    ids = [
        api.post(
            "/api/v1/jobs/", data=json.dumps({"model": "sdxl-sim", "prompt": p}), content_type="application/json"
        ).json()["id"]
        for p in ("a fox", "a whale", "a fox")
    ]
    # (This test's transaction holds back the encode messages; the first job's task runs here.)
    result = encode.run(ids[0])
    assert calls == [2], "three jobs, two distinct prompts, one encoder call"
    assert result == "3 encoded, 0 from the cache"
    jobs = {str(j.pk): j for j in Job.objects.all()}
    assert all(jobs[i].status == "denoising" and jobs[i].embeddings_key for i in ids)
    assert jobs[ids[0]].embeddings_key == jobs[ids[2]].embeddings_key != jobs[ids[1]].embeddings_key
    assert encode.run(ids[1]) == "skipped"  # its own message, delivered later, finds it encoded
