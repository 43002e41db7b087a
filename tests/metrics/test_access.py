"""Who may scrape GET /metrics: a staff session, or the bearer token of GENSERVER_METRICS_TOKEN."""

from __future__ import annotations

import pytest
from django.test import override_settings

from tests.support.waits import wait_for

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


def test_a_worker_node_serves_its_own_processes_without_the_cluster_part():
    """`python -m genserver.metrics serve`: the scrape target of a node that runs only workers."""
    import socket
    import threading
    import urllib.request

    from genserver import metrics

    metrics.REAPER_ACTIONS.labels("republished").inc(0)  # a series of this process, in the shared files
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    threading.Thread(target=metrics.serve, args=(port, "127.0.0.1"), daemon=True).start()

    def body() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                return response.read().decode()
        except OSError:
            return ""

    text = wait_for(body, what="the node exporter to answer")
    assert 'genserver_reaper_actions_total{action="republished"}' in text
    assert "genserver_jobs" not in text and "genserver_queue_depth" not in text  # the API exports those
