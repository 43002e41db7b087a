"""API tokens: make one (the raw key returned once), check a presented key, revoke.

A key is `gs_` + 8 random letters or digits (the public prefix that finds
the row) + 43 more (256 random bits). The database keeps the prefix
and the SHA-256 of the whole key, never the key: a copy of the table lets
nobody in, and a stored digest presented as a key is refused (it hashes to
another digest).

A fast hash is right here, unlike for passwords: PBKDF2, bcrypt and argon2
slow down guessing a low-entropy secret, but nobody can guess a uniformly
random 256-bit key at any hash speed (2^255 tries on average), and a
slow hash would cost every API request its work. Keys converted from DRF's
authtoken (40 hex characters, 160 random bits) are checked the same way:
their first 11 characters are their prefix, the SHA-256 of the whole key
their digest (the 116 bits not shown are still far past guessing).

Checking a key: the rows with its prefix, then a constant-time comparison
of digests (`hmac.compare_digest`), so the time taken does not tell how
much of a digest matched. Expired and revoked tokens are refused from that
moment on: each API process keeps a copy of the rows it read, used only while
nothing has changed a token, a user or a quota since (selectors/access.py).
`last_used_at` is written at most once a LAST_USED_RESOLUTION, so a busy
client does not cost a write per request.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import string
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from genserver.jobs import selectors
from genserver.jobs.models import ApiToken

KEY_START = "gs_"
PREFIX_LENGTH = len(KEY_START) + 8  # the part stored in clear: `gs_` and 8 random characters
KEY_ALPHABET = string.ascii_letters + string.digits
SECRET_CHARS = 43  # 43 × log2(62) = 256.03 random bits after the prefix
LAST_USED_RESOLUTION = timedelta(minutes=1)
MAX_LIVE_TOKENS_PER_USER = 100  # tokens neither expired nor revoked; one more is refused (revoke some first)


class TokenRefused(Exception):
    """A presented key that does not authenticate: unknown, expired or revoked (→ 401)."""


class TooManyTokens(Exception):
    """The user already holds MAX_LIVE_TOKENS_PER_USER live tokens (→ 400)."""


def digest_of(key: str) -> str:
    """SHA-256 of the key, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def prefix_of(key: str) -> str:
    return key[:PREFIX_LENGTH]


def new_key() -> str:
    """A fresh random key: `gs_`, 8 letters or digits of prefix, 43 of secret (62^43 > 2^256).

    Letters and digits only: a double click selects the whole key, and no shell or URL needs it quoted.
    """
    return KEY_START + "".join(
        secrets.choice(KEY_ALPHABET) for _ in range(PREFIX_LENGTH - len(KEY_START) + SECRET_CHARS)
    )


def default_expiry(now: datetime | None = None) -> datetime:
    return (now or timezone.now()) + timedelta(days=settings.API_TOKEN_DAYS)


def issue(
    user: Any, name: str = "", expires_at: datetime | None = None, *, never_expires: bool = False
) -> tuple[ApiToken, str]:
    """A new token of `user` and its raw key, the only time the key exists outside its owner's hands.

    `expires_at` None → GENSERVER_API_TOKEN_DAYS from now, unless `never_expires` (operators only:
    `manage.py issue_token --expires-in 0`).
    """
    now = timezone.now()
    with transaction.atomic():
        # The user's row, locked: two concurrent creates count each other's tokens.
        get_user_model().objects.select_for_update().filter(pk=user.pk).first()
        live = selectors.live_api_tokens(user, now).count()
        if live >= MAX_LIVE_TOKENS_PER_USER:
            raise TooManyTokens(
                f"You hold {live} live tokens, the most allowed: revoke one you no longer use "
                "(DELETE /api/v1/tokens/{id}/) and try again."
            )
        key = new_key()
        token = ApiToken.objects.create(
            user=user,
            name=name,
            prefix=prefix_of(key),
            digest=digest_of(key),
            created_at=now,
            expires_at=None if never_expires else (expires_at or default_expiry(now)),
        )
    return token, key


def key_in_header(header: str) -> str | None:
    """The key of an `Authorization: Token <key>` or `Bearer <key>` header; None for any other header."""
    parts = header.split()
    if len(parts) == 2 and parts[0].lower() in ("token", "bearer"):
        return parts[1]
    return None


TOKEN_COPY = "token"  # selectors.access's kind for a token's row and its user's, by the key's digest


def authenticate(key: str) -> ApiToken:
    """The live token whose key this is (its `user` loaded), or TokenRefused saying why."""
    if not key or len(key) <= PREFIX_LENGTH:
        raise TokenRefused("Invalid token.")
    wanted = digest_of(key)
    token_values, user_values = selectors.access.read_through(TOKEN_COPY, wanted, lambda: _rows_of(key, wanted))
    found = ApiToken.from_db(ApiToken.objects.db, _names(ApiToken), token_values)
    found.user = get_user_model().from_db(ApiToken.objects.db, _names(get_user_model()), user_values)
    now = timezone.now()
    state = found.state(now)
    if state == "revoked":
        raise TokenRefused(
            f"This token ({found.prefix}…) was revoked at {found.revoked_at:%Y-%m-%d %H:%M} UTC: "
            "use another one, or make one (POST /api/v1/tokens/ signed in, or `manage.py issue_token USER`)."
        )
    if state == "expired":
        raise TokenRefused(
            f"This token ({found.prefix}…) expired at {found.expires_at:%Y-%m-%d %H:%M} UTC: "
            "make a new one (POST /api/v1/tokens/ signed in, or `manage.py issue_token USER`)."
        )
    if not found.user.is_active:
        raise TokenRefused("User inactive or deleted.")
    if found.last_used_at is None or now - found.last_used_at >= LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=found.pk).update(last_used_at=now)
        found.last_used_at = now
        # The copy learns it too, or every request would write until the generation moves.
        at = _names(ApiToken).index("last_used_at")
        selectors.access.update_copy(
            TOKEN_COPY, wanted, lambda rows: ((*rows[0][:at], now, *rows[0][at + 1 :]), rows[1])
        )
    return found


def _rows_of(key: str, wanted: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The values of the token whose digest is `wanted` and of its user, read from the database; TokenRefused
    for an unknown key (nothing is kept for it). Digests compared in constant time: the time taken does not
    tell how much of one matched."""
    found = None
    for candidate in ApiToken.objects.select_related("user").filter(prefix=prefix_of(key)):
        if hmac.compare_digest(candidate.digest.encode(), wanted.encode()):
            found = candidate
    if found is None:
        raise TokenRefused("Invalid token.")
    return _values(found), _values(found.user)


@functools.cache
def _names(model: Any) -> list[str]:
    """The model's columns in `from_db`'s order (read on every request: built once)."""
    return [field.attname for field in model._meta.concrete_fields]


def _values(row: Any) -> tuple[Any, ...]:
    return tuple(getattr(row, name) for name in _names(row._meta.model))


def revoke(token: ApiToken) -> bool:
    """Revoke the token from now on; False when it was revoked already."""
    revoked = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    if revoked:
        selectors.access.forget()  # every API process's copy of it, from the commit on
    return bool(revoked)


def revoke_named(user: Any, name: str) -> int:
    """Revoke every live token of `user` called `name` (`issue_token --replace`); how many."""
    revoked = ApiToken.objects.filter(user=user, name=name, revoked_at__isnull=True).update(revoked_at=timezone.now())
    if revoked:
        selectors.access.forget()
    return revoked
