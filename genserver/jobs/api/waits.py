"""`Prefer: wait=N` (RFC 7240, as Replicate uses it): how long a submit may hold the request for its job to end."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from django.conf import settings

if TYPE_CHECKING:  # imported by genserver.serving before Django is set up: no DRF at import
    from rest_framework.request import Request

_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*\"?(\d{1,9})\"?(?=$|[,;\s])", re.IGNORECASE)


def asks_to_wait(prefer: str) -> bool:
    """Whether a Prefer header's value holds a well-formed `wait=N` (genserver.serving routes such a request to
    the handler whose waits cannot starve the others)."""
    return _WAIT.search(prefer) is not None


def preferred_wait(request: Request) -> int | None:
    """Seconds the client prefers to wait (cut to PREFER_WAIT_MAX_SECONDS), or None (no wait asked or allowed).

    A malformed preference is ignored, as RFC 7240 asks of preferences a server
    does not understand: the submit answers as without it.
    """
    cap = int(settings.PREFER_WAIT_MAX_SECONDS)
    match = _WAIT.search(request.headers.get("Prefer", ""))
    if match is None or cap <= 0:
        return None
    seconds = min(int(match.group(1)), cap)
    return seconds if seconds > 0 else None
