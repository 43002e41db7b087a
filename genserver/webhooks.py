"""Webhooks: a job's optional `webhook_url` receives signed JSON events.

Events: started (first denoising step), preview (each preview written),
segment (a long video's clip published; the body's `segment` says which),
succeeded, failed, cancelled. The job service calls `emit` right after the
transition commits; `emit` only publishes a `tasks.webhooks.deliver` message
on the `webhooks` queue, so no worker holding a card ever waits on HTTP.
The delivery task POSTs the body and retries with exponential backoff on a
connection error or a non-2xx answer (WEBHOOK_MAX_ATTEMPTS in all).

Each request carries (docs/ARCHITECTURE.md, "Webhooks", shows a receiver):
    X-Genserver-Event       the event name
    X-Genserver-Delivery    one id per event, the same on every retry (deduplicate on it)
    X-Genserver-Timestamp   Unix seconds when this attempt was signed
    X-Genserver-Signature   sha256=<hex HMAC-SHA256(WEBHOOK_SECRET, "<timestamp>." + raw body)>
Signing the timestamp with the body (as Standard Webhooks do) lets a receiver
refuse a replayed request: reject a timestamp more than a few minutes old.
`python manage.py webhook_secret` prints the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from genserver.jobs import broker

log = logging.getLogger(__name__)

# segment: a long video's clip; expired: its start deadline passed before it started
EVENTS = ("started", "preview", "segment", "succeeded", "failed", "cancelled", "expired")
SIGNATURE_HEADER = "X-Genserver-Signature"
TIMESTAMP_HEADER = "X-Genserver-Timestamp"
REPLAY_TOLERANCE_SECONDS = 300  # what `verify` accepts by default, like Standard Webhooks' 5 minutes
PREVIEW_THROTTLE_KEY = "genserver:webhook-preview:{job_id}"  # set while a preview webhook's window is open


class WebhookURLError(ValueError):
    """A webhook URL the service refuses to call."""


# --- URLs (the SSRF guard) --------------------------------------------------------------


def _refused_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global
    )


def check_url(url: str) -> None:
    """Raise WebhookURLError unless `url` is http(s), at most 500 characters, and (unless
    WEBHOOK_ALLOW_PRIVATE) every address its host resolves to is public."""
    if len(url) > 500:
        raise WebhookURLError("At most 500 characters.")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise WebhookURLError("Only http and https webhook URLs are accepted.")
    host = parts.hostname
    if not host:
        raise WebhookURLError("The webhook URL has no host.")
    if parts.username or parts.password:
        raise WebhookURLError("Credentials in the webhook URL are not accepted; verify the signature instead.")
    if settings.WEBHOOK_ALLOW_PRIVATE:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except (OSError, ValueError, UnicodeError):
        raise WebhookURLError(f"The webhook host {host!r} does not resolve.") from None
    if not addresses or any(_refused_address(a) for a in addresses):
        raise WebhookURLError(
            f"The webhook host {host!r} is a private, loopback or reserved address; "
            "only public hosts are accepted (for local testing, the server's operator can "
            "set GENSERVER_WEBHOOK_ALLOW_PRIVATE=1)."
        )


# --- payload and signature ----------------------------------------------------------------


def _absolute(path: str) -> str:
    return f"{settings.PUBLIC_URL}{path}"


def job_payload(job) -> dict[str, Any]:
    """The job as the event describes it (a subset of the API's representation)."""

    def stamp(value):
        return value.isoformat() if value else None

    return {
        "id": str(job.pk),
        "model": job.model,
        "kind": job.kind,
        "status": job.status,
        "stage": job.stage,
        "progress": {"step": job.steps_done, "total_steps": job.total_steps},
        "preview_url": _absolute(reverse("job-preview", args=[job.pk])) if job.preview_key else None,
        "preview_step": job.preview_step,
        "outputs": [
            {"url": _absolute(reverse("job-output", args=[job.pk, i])), "content_type": o["content_type"]}
            for i, o in enumerate(job.outputs)
        ],
        "segments": [
            {
                "index": s.index,
                "frames": s.frames,
                "content_type": "video/mp4",
                "url": _absolute(reverse("job-segment", args=[job.pk, s.index])),
            }
            for s in job.segments.filter(status="published").exclude(key="").order_by("index")
        ]
        if job.segment_count > 1
        else [],
        "error": job.error,
        "attempts": job.attempts,
        "url": _absolute(reverse("job-detail", args=[job.pk])),
        "created_at": stamp(job.created_at),
        "started_at": stamp(job.started_at),
        "finished_at": stamp(job.finished_at),
    }


def sign(body: bytes, timestamp: int | str, secret: str | None = None) -> str:
    """The X-Genserver-Signature value of a raw body sent at `timestamp` (Unix seconds)."""
    key = (secret if secret is not None else settings.WEBHOOK_SECRET).encode()
    return "sha256=" + hmac.new(key, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def verify(
    body: bytes,
    signature: str,
    timestamp: int | str,
    secret: str | None = None,
    tolerance: float = REPLAY_TOLERANCE_SECONDS,
    now: float | None = None,
) -> bool:
    """What a receiver does: the timestamp is recent (a replayed request is refused) and the header
    equals the HMAC of "<timestamp>." + the raw body, compared in constant time."""
    try:
        age = (time.time() if now is None else now) - int(timestamp)
    except (TypeError, ValueError):
        return False
    if abs(age) > tolerance:
        return False
    return hmac.compare_digest(sign(body, timestamp, secret), signature or "")


def encode_body(event: str, job: dict[str, Any], segment: dict[str, Any] | None = None) -> bytes:
    """The JSON body: the event, the job, and for a `segment` event the segment it is about."""
    body: dict[str, Any] = {"event": event, "job": job, "sent_at": timezone.now().isoformat()}
    if segment is not None:
        body["segment"] = segment
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def segment_payload(job, index: int) -> dict[str, Any]:
    """Which segment a `segment` event is for: its index, frames and URLs."""
    segment = job.segments.get(index=index)
    return {
        "index": index,
        "frames": segment.frames,
        "content_type": "video/mp4",
        "url": _absolute(reverse("job-segment", args=[job.pk, index])),
        "poster_url": _absolute(reverse("job-segment-poster", args=[job.pk, index])),
    }


# --- enqueue (job service side) -----------------------------------------------------------


def emit(job_id, event: str, segment: int | None = None, row: Any = None) -> None:
    """Publish `event` of the job to the `webhooks` queue if it has a webhook URL (`segment`: the
    index a `segment` event is for; the payload then carries it under "segment"). `row`: the job as the
    transition that made the event true left it, when the caller has it (no read then; most jobs have no URL).

    Called after the transition committed. Best effort: a broker error is logged,
    never raised into the worker that made the transition.
    """
    from genserver.jobs.models import Job

    try:
        job = row if row is not None else Job.objects.filter(pk=job_id).exclude(webhook_url="").first()
        if job is None or not job.webhook_url or event not in job.webhook_events:
            return  # no webhook, or not an event it asked for
        if event == "preview" and not _preview_due(job.pk):
            return  # a preview was sent less than WEBHOOK_PREVIEW_SECONDS ago; a later one supersedes this
        payload = job_payload(job)
        if segment is not None:
            payload["segment"] = segment_payload(job, segment)  # encode_body moves it to the top level
        broker.send_webhook(job.pk, event, payload)
    except Exception:
        log.warning("could not enqueue webhook %s of job %s", event, job_id, exc_info=True)


def _preview_due(job_id) -> bool:
    """At most one preview per WEBHOOK_PREVIEW_SECONDS per job: the first caller in each window takes it."""
    window_ms = int(settings.WEBHOOK_PREVIEW_SECONDS * 1000)
    if window_ms <= 0:
        return True
    from genserver.redis_client import client

    return bool(client().set(PREVIEW_THROTTLE_KEY.format(job_id=job_id), "1", nx=True, px=window_ms))


# --- delivery (webhooks worker side) ------------------------------------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a hop: following it could reach a host check_url refused."""

    def redirect_request(self, *args, **kwargs):
        return None


_opener = urllib.request.build_opener(_NoRedirect)


def post(url: str, event: str, delivery: str, body: bytes, timeout: float | None = None) -> int:
    """POST one signed event, timestamped now; returns the HTTP status (2xx). Raises on a connection
    error or non-2xx."""
    timestamp = int(time.time())
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "genserver-webhooks/1",
            "X-Genserver-Event": event,
            "X-Genserver-Delivery": delivery,
            TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: sign(body, timestamp),
        },
    )
    timeout = settings.WEBHOOK_TIMEOUT_SECONDS if timeout is None else timeout
    with _opener.open(request, timeout=timeout) as response:
        response.read(65536)
        status = response.status
    if not 200 <= status < 300:
        raise urllib.error.HTTPError(url, status, f"answered {status}", None, None)
    return status
