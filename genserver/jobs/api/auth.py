"""The API's tokens on a request: `Authorization: Token <key>` and `Authorization: Bearer <key>` (OpenAI clients).

Both look the key up in the hashed ApiToken rows (genserver/jobs/services/tokens.py): an unknown, expired
or revoked key is a 401 at once. `request.auth` is the ApiToken.
"""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication

from genserver.jobs.services import tokens


class ApiTokenAuthentication(TokenAuthentication):
    """`Authorization: Token <key>`: DRF's header parsing, our hashed tokens (not DRF's authtoken rows)."""

    keyword = "Token"

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        try:
            token = tokens.authenticate(key)
        except tokens.TokenRefused as refused:
            raise exceptions.AuthenticationFailed(str(refused)) from None
        return token.user, token


class BearerTokenAuthentication(ApiTokenAuthentication):
    """The same tokens under the `Bearer` keyword."""

    keyword = "Bearer"


def authenticate_header_token(request: Any) -> tuple[Any, Any] | None:
    """(user, token) from a `Token` or `Bearer` header, None without one; AuthenticationFailed for a bad one.

    For views outside DRF (the event stream, /metrics), which read a Django HttpRequest.
    """
    for scheme in (ApiTokenAuthentication(), BearerTokenAuthentication()):
        found = scheme.authenticate(request)
        if found is not None:
            return found
    return None
