"""`Authorization: Bearer <token>`: the API's own tokens under the keyword OpenAI clients send."""

from __future__ import annotations

from rest_framework.authentication import TokenAuthentication


class BearerTokenAuthentication(TokenAuthentication):
    """DRF's token authentication with the `Bearer` keyword (the same Token rows as `Token <key>`)."""

    keyword = "Bearer"
