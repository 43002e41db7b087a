"""Webhooks: signed JSON events per job, delivered from the `webhooks` queue with retries.

A local HTTP server thread on 127.0.0.1 plays the receiver and records every request.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.conf import settings

from genserver import webhooks
from tests.support.api import submit
from tests.support.waits import finished, job_row, wait_for

VIDEO = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 81}


class Receiver:
    """Records requests; `fail[event]` is how many times to answer 500 before 200 for that event."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.fail: dict[str, int] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                event = self.headers.get("X-Genserver-Event", "")
                with receiver.lock:
                    left = receiver.fail.get(event, 0)
                    status = 500 if left else 200
                    if left:
                        receiver.fail[event] = left - 1
                    receiver.requests.append(
                        {
                            "path": self.path,
                            "headers": dict(self.headers),
                            "body": body,
                            "status": status,
                            "at": time.monotonic(),
                        }
                    )
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def delivered(self, path: str) -> list[dict]:
        """Bodies of the requests to `path` answered 200, in arrival order."""
        with self.lock:
            return [
                json.loads(r["body"]) | {"_headers": r["headers"]}
                for r in self.requests
                if r["path"] == path and r["status"] == 200
            ]

    def events(self, path: str) -> list[str]:
        return [b["event"] for b in self.delivered(path)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def assert_signed(request: dict) -> None:
    """What a receiver in any language does, written out: HMAC-SHA256 of "<timestamp>." + the raw body."""
    headers = {k.lower(): v for k, v in request["headers"].items()}
    signed = headers["x-genserver-timestamp"].encode() + b"." + request["body"]
    expected = "sha256=" + hmac.new(settings.WEBHOOK_SECRET.encode(), signed, hashlib.sha256).hexdigest()
    assert headers["x-genserver-signature"] == expected
    assert abs(time.time() - int(headers["x-genserver-timestamp"])) < 600
    assert headers["content-type"] == "application/json"
    assert headers["x-genserver-event"] == json.loads(request["body"])["event"]
    assert len(headers["x-genserver-delivery"]) == 36  # a uuid


# --- unit ------------------------------------------------------------------------------------


def test_signature_verifies_with_the_secret(receiver):
    body = webhooks.encode_body("succeeded", {"id": "x", "status": "succeeded"})
    assert webhooks.post(receiver.url(), "succeeded", "0" * 8 + "-0000-0000-0000-" + "0" * 12, body) == 200
    request = receiver.requests[0]
    assert request["body"] == body
    assert_signed(request)
    signature, stamp = request["headers"]["X-Genserver-Signature"], request["headers"]["X-Genserver-Timestamp"]
    assert webhooks.verify(body, signature, stamp)
    assert not webhooks.verify(body + b" ", signature, stamp)
    assert not webhooks.verify(body, signature, int(stamp) + 1)  # the timestamp is signed too
    assert not webhooks.verify(body, signature, stamp, secret="another secret")
    # A request replayed later than the tolerance is refused even with its valid signature.
    assert not webhooks.verify(body, signature, stamp, now=int(stamp) + webhooks.REPLAY_TOLERANCE_SECONDS + 1)
    assert set(json.loads(body)) == {"event", "job", "sent_at"}


def test_the_signing_secret_is_printed_by_a_management_command():
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("webhook_secret", stdout=out, stderr=StringIO())
    assert out.getvalue().strip() == settings.WEBHOOK_SECRET


def test_non_2xx_raises_so_the_task_retries(receiver):
    receiver.fail["failed"] = 1
    with pytest.raises(OSError):
        webhooks.post(receiver.url(), "failed", "d", webhooks.encode_body("failed", {}))


def test_private_hosts_are_refused_unless_allowed(settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    for url in (
        "http://127.0.0.1:8000/x",
        "http://localhost/x",
        "http://10.1.2.3/x",
        "http://169.254.169.254/",
        "http://[::1]/x",
        "http://[::ffff:127.0.0.1]/x",
    ):
        with pytest.raises(webhooks.WebhookURLError):
            webhooks.check_url(url)
    with pytest.raises(webhooks.WebhookURLError):
        webhooks.check_url("file:///etc/passwd")
    with pytest.raises(webhooks.WebhookURLError, match="GENSERVER_WEBHOOK_ALLOW_PRIVATE"):
        webhooks.check_url("http://127.0.0.1:8000/x")  # the refusal says how to allow it for local testing
    settings.WEBHOOK_ALLOW_PRIVATE = True
    webhooks.check_url("http://127.0.0.1:8000/x")


# --- validation ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_webhook_url_is_accepted_and_shown(api):
    response = submit(api, webhook_url="http://127.0.0.1:9/hook")
    assert response.status_code == 201, response.content
    assert response.json()["webhook_url"] == "http://127.0.0.1:9/hook"
    assert job_row(response.json()["id"]).webhook_url == "http://127.0.0.1:9/hook"
    assert submit(api).json()["webhook_url"] == ""


@pytest.mark.django_db
@pytest.mark.parametrize(
    "url", ["ftp://example.com/hook", "javascript:alert(1)", "not a url", "http://example.com/" + "x" * 500]
)
def test_bad_webhook_url_is_refused(api, url):
    response = submit(api, webhook_url=url)
    assert response.status_code == 400, response.content
    assert "webhook_url" in response.json()


@pytest.mark.django_db
def test_private_webhook_host_is_refused_when_not_allowed(api, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    response = submit(api, webhook_url="http://127.0.0.1:8080/hook")
    assert response.status_code == 400, response.content
    assert "private" in json.dumps(response.json()["webhook_url"])


# --- end to end (real workers) ---------------------------------------------------------------


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)
def test_job_receives_started_preview_and_succeeded_in_order_signed(stack, api, receiver):
    response = submit(
        api,
        model="tiny-sd",
        prompt="a red fox",
        steps=10,
        preview_every=5,
        webhook_url=receiver.url("/ok"),
        webhook_events=["started", "preview", "succeeded"],
    )
    assert response.status_code == 201, response.content
    job_id = response.json()["id"]
    assert finished(job_id, timeout=120).status == "succeeded"
    wait_for(lambda: "succeeded" in receiver.events("/ok"), 30, what="the succeeded event")
    events = receiver.events("/ok")
    assert events == ["started", "preview", "succeeded"], events
    for request in receiver.requests:
        assert_signed(request)
    bodies = receiver.delivered("/ok")
    assert all(b["job"]["id"] == job_id for b in bodies)
    assert bodies[0]["job"]["status"] == "denoising" and bodies[0]["job"]["started_at"]
    assert bodies[1]["job"]["preview_step"] == 5 and bodies[1]["job"]["preview_url"].endswith("/preview/")
    assert bodies[1]["job"]["progress"]["step"] >= 5  # the step the preview was taken at, not 0
    done = bodies[2]["job"]
    assert done["status"] == "succeeded" and done["progress"] == {"step": 10, "total_steps": 10}
    assert done["outputs"] and done["outputs"][0]["url"].endswith(f"/api/v1/jobs/{job_id}/outputs/0/")
    assert len({b["_headers"]["X-Genserver-Delivery"] for b in bodies}) == 3


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)
def test_cancelled_job_receives_cancelled(stack, api, receiver):
    job_id = submit(api, **VIDEO, webhook_url=receiver.url("/cancel")).json()["id"]
    wait_for(lambda: job_row(job_id).steps_done >= 1, 30, what="a step")
    assert api.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 202
    assert finished(job_id, timeout=10).status == "cancelled"
    wait_for(lambda: "cancelled" in receiver.events("/cancel"), 30, what="the cancelled event")
    assert receiver.events("/cancel") == ["started", "cancelled"]
    assert receiver.delivered("/cancel")[-1]["job"]["status"] == "cancelled"


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)
def test_failing_receiver_gets_the_event_on_the_third_try(stack, api, receiver):
    receiver.fail["succeeded"] = 2
    job_id = submit(api, webhook_url=receiver.url("/flaky")).json()["id"]
    assert finished(job_id).status == "succeeded"
    wait_for(lambda: "succeeded" in receiver.events("/flaky"), 30, what="the succeeded event after retries")
    tries = [r for r in receiver.requests if r["headers"].get("X-Genserver-Event") == "succeeded"]
    assert [r["status"] for r in tries] == [500, 500, 200]
    assert len({r["headers"]["X-Genserver-Delivery"] for r in tries}) == 1, "one delivery id across retries"
    # Retry n is an ETA message BACKOFF × 2^(n-1) after the failure: never earlier, however busy the
    # machine (a lower bound, so no wall-clock ceiling to flake on).
    gaps = [b["at"] - a["at"] for a, b in zip(tries, tries[1:])]
    backoff = settings.WEBHOOK_BACKOFF_SECONDS
    assert gaps[0] >= backoff and gaps[1] >= 2 * backoff, f"a retry came before its backoff: {gaps}"


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)
def test_a_poll_during_denoising_shows_the_previews_step(stack, api):
    # Chunks of several seconds' work (this class's chunk) hold progress between heartbeats: the preview moves it.
    job_id = submit(api, **VIDEO, steps=40, preview_every=4).json()["id"]

    def preview_while_denoising():
        body = api.get(f"/api/v1/jobs/{job_id}/").json()
        return body if body["status"] == "denoising" and body["preview_step"] > 0 else None

    body = wait_for(preview_while_denoising, 60, interval=0.02, what="a preview during denoising")
    assert body["progress"]["step"] >= body["preview_step"] > 0, body
    api.post(f"/api/v1/jobs/{job_id}/cancel/")


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)
def test_each_segment_event_says_which_segment_it_is_for(stack, api, receiver):
    response = submit(
        api,
        model="wan-sim",
        width=832,
        height=480,
        num_frames=161,
        steps=20,
        webhook_url=receiver.url("/segments"),
        webhook_events=["segment", "succeeded"],
    )
    assert response.status_code == 201, response.content
    job_id = response.json()["id"]
    assert finished(job_id, timeout=120).status == "succeeded"
    wait_for(lambda: "succeeded" in receiver.events("/segments"), 30, what="the succeeded event")
    segment_events = [b for b in receiver.delivered("/segments") if b["event"] == "segment"]
    assert sorted(b["segment"]["index"] for b in segment_events) == [0, 1]
    for body in segment_events:
        segment = body["segment"]
        assert segment["url"].endswith(f"/api/v1/jobs/{job_id}/segments/{segment['index']}/")
        assert segment["poster_url"].endswith("/poster/") and segment["frames"] > 0
        assert segment["index"] in [s["index"] for s in body["job"]["segments"]]
    assert all("segment" not in b for b in receiver.delivered("/segments") if b["event"] != "segment")


# --- which events, and how often (issue 13) ------------------------------------------------------


@pytest.mark.django_db
def test_webhook_events_default_to_started_and_the_end(api):
    body = submit(api, webhook_url="http://127.0.0.1:9/hook").json()
    assert body["webhook_events"] == ["started", "succeeded", "failed", "cancelled", "expired"]
    chosen = submit(api, webhook_url="http://127.0.0.1:9/hook", webhook_events=["succeeded", "preview", "preview"])
    assert chosen.status_code == 201, chosen.content
    assert chosen.json()["webhook_events"] == ["preview", "succeeded"]  # once each, in the order they happen
    assert job_row(chosen.json()["id"]).webhook_events == ["preview", "succeeded"]
    assert submit(api, webhook_url="http://127.0.0.1:9/hook", webhook_events=[]).json()["webhook_events"] == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    "events, field", [(["done"], "webhook_events"), ("succeeded", "webhook_events"), ([1], "webhook_events")]
)
def test_unknown_webhook_events_are_refused(api, events, field):
    from genserver.jobs.models import Job

    before = Job.objects.count()
    response = submit(api, webhook_url="http://127.0.0.1:9/hook", webhook_events=events)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert Job.objects.count() == before


@pytest.mark.django_db
def test_webhook_events_without_a_url_are_refused(api):
    response = submit(api, webhook_events=["succeeded"])
    assert response.status_code == 400
    assert "webhook_url" in response.json()["webhook_events"][0]


@pytest.mark.django_db
def test_events_not_asked_for_are_not_sent(api, monkeypatch):
    from tests.support.broker import capture_sends

    sent = capture_sends(monkeypatch, "send_webhook")
    job_id = submit(api, webhook_url="http://127.0.0.1:9/hook", webhook_events=["succeeded"]).json()["id"]
    for event in ("started", "preview", "cancelled", "succeeded"):
        webhooks.emit(job_id, event)
    assert [call[2] for call in sent] == ["succeeded"]


@pytest.mark.django_db
def test_previews_are_throttled_to_one_per_window(api, monkeypatch, settings, redis_conn):
    from tests.support.broker import capture_sends

    settings.WEBHOOK_PREVIEW_SECONDS = 0.5
    sent = capture_sends(monkeypatch, "send_webhook")
    job_id = submit(api, webhook_url="http://127.0.0.1:9/hook", webhook_events=["preview", "succeeded"]).json()["id"]
    started = time.monotonic()
    for _ in range(20):
        webhooks.emit(job_id, "preview")
    burst = len(sent)
    assert burst == 1 or time.monotonic() - started >= 0.5, f"{burst} previews sent in one window"
    # The next window opens after WEBHOOK_PREVIEW_SECONDS: a later preview goes out.
    wait_for(
        lambda: webhooks.emit(job_id, "preview") or len(sent) > burst, 10, interval=0.05, what="the next preview window"
    )
    assert time.monotonic() - started >= 0.5
    webhooks.emit(job_id, "succeeded")  # terminal events are never throttled
    assert [call[2] for call in sent][-1] == "succeeded"
    settings.WEBHOOK_PREVIEW_SECONDS = 0
    before = len(sent)
    webhooks.emit(job_id, "preview")
    webhooks.emit(job_id, "preview")
    assert len(sent) == before + 2  # 0 turns the throttle off


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)
def test_a_webhook_gets_only_its_events_and_throttled_previews(stack, api, receiver):
    job_id = submit(
        api,
        model="tiny-sd",
        prompt="a red fox",
        steps=12,
        preview_every=1,
        webhook_url=receiver.url("/some"),
        webhook_events=["preview", "succeeded"],
    ).json()["id"]
    job = finished(job_id, timeout=120)
    assert job.status == "succeeded"
    wait_for(lambda: "succeeded" in receiver.events("/some"), 30, what="the succeeded event")
    events = receiver.events("/some")
    assert set(events) == {"preview", "succeeded"} and events[-1] == "succeeded", events  # no `started`
    previews = events.count("preview")
    denoise_seconds = (job.finished_at - job.started_at).total_seconds()
    # 12 previews were written; at most one per 0.5 s window of the job's run left the service.
    assert 1 <= previews <= 1 + denoise_seconds / settings.WEBHOOK_PREVIEW_SECONDS, (previews, denoise_seconds)
