"""API tokens: a user's tokens, and those still usable (services/tokens.py writes them)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet
from django.utils import timezone

from genserver.jobs.models import ApiToken


# --- API tokens (genserver/jobs/services/tokens.py writes them) ---------------------------------------------
def api_tokens_of(user: Any) -> QuerySet[ApiToken]:
    """The user's tokens not revoked (expired ones included, newest first): GET /api/v1/tokens/."""
    return ApiToken.objects.filter(user=user, revoked_at__isnull=True).order_by("-created_at", "-pk")


def live_api_tokens(user: Any, now: datetime | None = None) -> QuerySet[ApiToken]:
    """The user's tokens that authenticate now (neither expired nor revoked)."""

    return api_tokens_of(user).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now or timezone.now()))
