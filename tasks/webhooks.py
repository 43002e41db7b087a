"""Webhook delivery (queue `webhooks`): POST one signed event, retried with exponential backoff.

The `webhooks` queue is not a GPU queue, so countdown retries (ETA messages)
are fine here; the worker that consumes it holds no card.
"""

from __future__ import annotations

import http.client
import logging
import urllib.error

from celery import shared_task
from django.conf import settings

from genserver import webhooks
from genserver.jobs import broker
from genserver.jobs.models import Job
from genserver.jobs.services import Outcome

log = logging.getLogger(__name__)


@shared_task(name=broker.WEBHOOK_TASK.name, bind=True, max_retries=None)
def deliver(self, job_id: str, event: str, payload: dict) -> str:
    url = Job.objects.filter(pk=job_id).values_list("webhook_url", flat=True).first()
    if not url:
        return Outcome.SKIPPED  # the job is gone (or has no webhook any more)
    attempt = self.request.retries + 1
    try:
        webhooks.check_url(url)  # again at delivery: DNS may now point somewhere the guard refuses
    except webhooks.WebhookURLError as exc:
        log.warning("webhook %s of job %s not sent to %s: %s", event, job_id, url, exc)
        return Outcome.REFUSED
    payload = dict(payload)
    body = webhooks.encode_body(event, payload, segment=payload.pop("segment", None))
    delivery = self.request.id or "local"
    try:
        webhooks.post(url, event, delivery, body)
        return Outcome.DELIVERED
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason = f"{exc.code} {exc.reason}" if isinstance(exc, urllib.error.HTTPError) else repr(exc)
        if attempt >= settings.WEBHOOK_MAX_ATTEMPTS:
            log.warning(
                "webhook %s of job %s to %s: giving up after %d attempts; last: %s", event, job_id, url, attempt, reason
            )
            return Outcome.GAVE_UP
        countdown = settings.WEBHOOK_BACKOFF_SECONDS * 2 ** (attempt - 1)
        log.info(
            "webhook %s of job %s to %s failed (%s); attempt %d in %.1f s",
            event,
            job_id,
            url,
            reason,
            attempt + 1,
            countdown,
        )
        raise self.retry(countdown=countdown, exc=exc) from None
