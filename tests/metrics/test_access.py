"""Who may scrape GET /metrics: a staff session, or the bearer token of GENSERVER_METRICS_TOKEN."""
from __future__ import annotations

import pytest
from django.test import override_settings

from .scrapes import scrape

pytestmark = pytest.mark.django_db


def test_metrics_needs_staff_or_the_bearer_token(api, client):
    assert client.get("/metrics").status_code == 403
    api.force_login(api.user)  # signed in, not staff
    assert api.get("/metrics").status_code == 403
    with override_settings(METRICS_TOKEN="s3cret-scrape-token"):
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
        samples = scrape(client, HTTP_AUTHORIZATION="Bearer s3cret-scrape-token")
    assert ("genserver_jobs", frozenset({("status", "queued")})) in samples
    with override_settings(METRICS_TOKEN=""):  # no token set: a bearer never works
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 403
