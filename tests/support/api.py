"""The REST API as a client calls it: submit a job, download a file."""

from __future__ import annotations

import json


def submit(client, **fields):
    """POST /api/v1/jobs/ (sdxl-sim, a lighthouse at dusk, unless `fields` say otherwise)."""
    body = {"model": "sdxl-sim", "prompt": "a lighthouse at dusk"} | fields
    return client.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json")


def download(client, url: str) -> bytes:
    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return b"".join(response.streaming_content)
