"""Who may scrape GET /metrics: a staff session or a staff user's API token, or the bearer token of
GENSERVER_METRICS_TOKEN; a worker node's exporter asks for that token whenever it listens beyond loopback."""

from __future__ import annotations

import pytest
from django.test import override_settings

from tests.support.waits import wait_for
from workers.bundled_redis import free_port

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


def test_metrics_takes_a_staff_users_api_token_and_refuses_others(make_user, client, monkeypatch):
    from datetime import timedelta

    from django.utils import timezone

    from genserver.jobs.services import tokens

    staff = make_user("root", staff=True)
    plain = make_user("bob")
    staff_token, staff_key = tokens.issue(staff.user)
    _, plain_key = tokens.issue(plain.user)
    for keyword in ("Token", "Bearer"):
        assert client.get("/metrics", HTTP_AUTHORIZATION=f"{keyword} {staff_key}").status_code == 200
        assert client.get("/metrics", HTTP_AUTHORIZATION=f"{keyword} {plain_key}").status_code == 403
    with monkeypatch.context() as clock:  # past the token's expiry, then back
        clock.setattr(timezone, "now", lambda: staff_token.expires_at + timedelta(seconds=1))
        assert client.get("/metrics", HTTP_AUTHORIZATION=f"Token {staff_key}").status_code == 403
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Token {staff_key}").status_code == 200
    tokens.revoke(staff_token)
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Token {staff_key}").status_code == 403


def test_a_worker_nodes_exporter_beyond_loopback_needs_the_metrics_token():
    import threading
    import urllib.error
    import urllib.request

    from genserver import metrics

    for address in ("0.0.0.0", "::", "10.1.2.3", "gpu-a.example.com"):  # refused before anything listens
        with pytest.raises(ValueError, match="GENSERVER_METRICS_TOKEN"):
            metrics.serve(free_port(), address, token="")
    # With the token set every scrape must send it (here on loopback: the tests listen nowhere else).
    port = free_port()
    threading.Thread(target=metrics.serve, args=(port, "127.0.0.1", "node-scrape-secret"), daemon=True).start()

    def status(headers: dict[str, str]) -> int | None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as refused:
            return refused.code
        except OSError:
            return None  # not listening yet

    assert wait_for(lambda: status({}), what="the node exporter to answer") == 401
    assert status({"Authorization": "Bearer wrong"}) == 401
    assert status({"Authorization": "Bearer node-scrape-secret"}) == 200


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
    threading.Thread(target=metrics.serve, args=(port, "127.0.0.1", ""), daemon=True).start()

    def body() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                return response.read().decode()
        except OSError:
            return ""

    text = wait_for(body, what="the node exporter to answer")
    assert 'genserver_reaper_actions_total{action="republished"}' in text
    assert "genserver_jobs" not in text and "genserver_queue_depth" not in text  # the API exports those


def test_a_worker_node_with_nothing_written_yet_answers_an_empty_scrape(monkeypatch):
    """A node's exporter started before its workers (the order docs/METRICS.md gives) is up, not a 404."""
    import threading
    import urllib.error
    import urllib.request

    from genserver import metrics

    monkeypatch.setattr(metrics, "scrape", lambda cluster=True: b"")  # an empty multiprocess directory
    port = free_port()
    threading.Thread(target=metrics.serve, args=(port, "127.0.0.1", ""), daemon=True).start()

    def answer(path: str) -> tuple[int, bytes] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as refused:
            return refused.code, b""
        except OSError:
            return None  # not listening yet

    assert wait_for(lambda: answer("/metrics"), what="the node exporter to answer") == (200, b"")
    assert answer("/other") == (404, b"")
