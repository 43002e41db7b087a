"""Limits on POST /api/v1/jobs/ that refuse a request before it costs anything.

* `SubmitRateThrottle`: at most SUBMIT_RATE_LIMIT accepted jobs per user in any
  SUBMIT_RATE_WINDOW seconds → 429 with Retry-After (when the oldest of them
  leaves the window). Counted in the database (the jobs themselves), so every
  API process sees the same count and nothing depends on Redis.
* The per-user limit on unfinished jobs lives in the job service
  (`services.check_in_flight`, inside the submit transaction).
* `check_body_size`: a body over DATA_UPLOAD_MAX_MEMORY_SIZE → 413 with a JSON reason.
* `SubmitJSONParser`: JSON only (another content type → 415); a document nested
  too deeply for the decoder is a 400, not a 500.
"""

from __future__ import annotations

import math
from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from rest_framework import exceptions, status
from rest_framework.parsers import JSONParser
from rest_framework.throttling import BaseThrottle


class SubmitRateLimited(exceptions.Throttled):
    def __init__(self, wait: int, limit: int, window: float) -> None:
        super().__init__(wait=wait)
        self.detail = {
            "detail": f"Too many submissions: at most {limit} jobs per {window:g} s; retry in {wait} s.",
            "reason": "rate_limited",
            "limit": limit,
            "window_seconds": window,
            "retry_after": wait,
        }


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "too_large"

    def __init__(self, length: int, limit: int) -> None:
        super().__init__()
        self.detail = {
            "detail": f"Request body is {length} bytes; at most {limit} are accepted.",
            "reason": "too_large",
            "limit_bytes": limit,
        }


class SubmitRateThrottle(BaseThrottle):
    """Per-user submit rate, from the user's own recent jobs. Only POST counts; reads are free."""

    def allow_request(self, request, view) -> bool:
        limit, window = settings.SUBMIT_RATE_LIMIT, settings.SUBMIT_RATE_WINDOW
        user = request.user
        if request.method != "POST" or limit <= 0 or not (user and user.is_authenticated):
            return True
        from genserver.jobs.models import Job

        now = timezone.now()
        recent = list(
            Job.objects.filter(owner=user, created_at__gte=now - timedelta(seconds=window))
            .order_by("-created_at")
            .values_list("created_at", flat=True)[:limit]
        )
        if len(recent) < limit:
            return True
        # The next submit fits once the oldest of the last `limit` jobs is out of the window.
        wait = max(1, math.ceil((recent[-1] + timedelta(seconds=window) - now).total_seconds()))
        raise SubmitRateLimited(wait, limit, window)


def check_body_size(request) -> None:
    """Refuse an oversized body from its Content-Length, before anything reads it."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise exceptions.ParseError("Invalid Content-Length header.") from None
    if limit is not None and length > limit:
        raise RequestTooLarge(length, limit)


class SubmitJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - the document is nested too deeply.") from None
