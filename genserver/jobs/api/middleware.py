"""The request's scope for what is read once per request: the access generation (selectors/access.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from genserver.jobs.selectors import access


class AccessScopeMiddleware:
    """Each request checks its per-process copies (token, quota rows) against one read of the generation."""

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        with access.per_request():
            return self.get_response(request)
