"""The page's server side without a browser: sign-in redirects, the shell page, and the API under session + CSRF."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.support.broker import capture_sends
from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch):
    """The messages the job service publishes (no broker needed)."""
    return capture_sends(monkeypatch, "send_chunk", "send_decode", "send_encode")


def test_the_page_asks_a_stranger_to_sign_in():
    response = Client().get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    login = Client().get(response["Location"])
    assert login.status_code == 200 and b'id="login-form"' in login.content


def test_a_wrong_password_is_said_so(make_person):
    make_person("alice")
    response = Client().post("/login/", {"username": "alice", "password": "nope"})
    assert response.status_code == 200 and b'id="login-error"' in response.content


def test_signed_in_the_page_and_its_static_files_are_served(make_person):
    make_person("alice")
    client = Client()
    assert client.login(username="alice", password=PASSWORD)
    page = client.get("/")
    assert page.status_code == 200
    assert b'id="submit-form"' in page.content and b"web/app.js" in page.content
    assert b'id="queues-panel"' not in page.content and b'id="admin-link"' not in page.content  # not staff
    assert "csrftoken" in page.cookies  # the script sends it back as X-CSRFToken
    assert b"watchJob" in b"".join(client.get("/static/web/app.js").streaming_content)


def test_staff_get_the_queues_panel_and_the_admin_and_flower_links(make_person, settings):
    make_person("sam", staff=True)
    client = Client()
    client.login(username="sam", password=PASSWORD)
    page = client.get("/", HTTP_HOST="localhost:8000").content.decode()
    assert 'id="queues-panel"' in page and 'href="/admin/"' in page
    assert f'href="http://localhost:{settings.FLOWER_PORT}/"' in page


def test_the_api_takes_the_session_with_its_csrf_token_and_refuses_it_without(make_person, sent):
    make_person("alice")
    client = Client(enforce_csrf_checks=True)
    client.login(username="alice", password=PASSWORD)
    client.get("/")  # sets the csrftoken cookie, as the page does
    job = {"model": "tiny-sd", "prompt": "a cat"}
    refused = client.post("/api/v1/jobs/", job, content_type="application/json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    accepted = client.post(
        "/api/v1/jobs/", job, content_type="application/json", HTTP_X_CSRFTOKEN=client.cookies["csrftoken"].value
    )
    assert accepted.status_code == 201, accepted.content
    assert accepted.json()["owner"] == "alice" and accepted.json()["status"] == "queued"


def test_signing_out_ends_the_session(make_person):
    make_person("alice")
    client = Client()
    client.login(username="alice", password=PASSWORD)
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302
    assert client.get("/api/v1/jobs/").status_code in (401, 403)
