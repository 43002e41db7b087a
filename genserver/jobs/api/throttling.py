"""Limits on POST /api/v1/jobs/ that refuse a request before it costs anything.

* The per-user limits (jobs in flight, submits per minute, card-seconds per day,
  models and lanes) live in the job service (`services/quotas.py`, inside the
  submit transaction with the user's row locked).
* `check_body_size`: a body over DATA_UPLOAD_MAX_MEMORY_SIZE → 413 with a JSON reason.
* `SubmitJSONParser`: JSON only (another content type → 415); a document nested
  too deeply for the decoder is a 400, not a 500.
"""

from __future__ import annotations

from django.conf import settings
from rest_framework import exceptions, status
from rest_framework.parsers import JSONParser


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
