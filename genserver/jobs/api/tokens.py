"""/api/v1/tokens/: the signed-in user's own API tokens: list, create (the raw key shown once), revoke."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from genserver.jobs import selectors
from genserver.jobs.api import throttling
from genserver.jobs.api.schema import error_responses
from genserver.jobs.api.serializers import StrictIntegerField
from genserver.jobs.models import ApiToken
from genserver.jobs.services import tokens

MAX_TOKEN_DAYS = 3650  # the longest lifetime a request may ask for


class StrictCharField(serializers.CharField):
    """Text given as a JSON string: a number or a boolean is a 400, not turned into text."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class ApiTokenSerializer(serializers.ModelSerializer):
    """One token as its owner sees it: never its key (only the POST that made it shows that)."""

    state = serializers.SerializerMethodField(help_text="active or expired (revoked tokens are not listed)")

    class Meta:
        model = ApiToken
        fields = ("id", "name", "prefix", "created_at", "expires_at", "last_used_at", "state")
        read_only_fields = fields

    def get_state(self, token: ApiToken) -> str:
        return token.state()


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    key = serializers.CharField(help_text="the key: shown this once, stored only as a hash; keep it now")

    class Meta(ApiTokenSerializer.Meta):
        fields = (*ApiTokenSerializer.Meta.fields, "key")
        read_only_fields = fields


class ApiTokenCreateSerializer(serializers.Serializer):
    """POST /api/v1/tokens/."""

    name = StrictCharField(max_length=100, required=False, allow_blank=True, default="", help_text="what it is for")
    expires_in_days = StrictIntegerField(
        min_value=1,
        max_value=MAX_TOKEN_DAYS,
        required=False,
        help_text="its lifetime (default GENSERVER_API_TOKEN_DAYS); a token made with a token lives no longer "
        "than that token",
    )

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": ['Send a JSON object: {"name": "...", "expires_in_days": N}.']}
            )
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {k: ["Unknown field; a token takes `name` and `expires_in_days`."] for k in unknown}
            )
        return super().to_internal_value(data)


def _expiry(request: Request, days: int | None) -> Any:
    """When the new token expires: as asked (or the default), never after the token the request came with."""
    now = timezone.now()
    wanted = now + timedelta(days=days if days is not None else settings.API_TOKEN_DAYS)
    maker = request.auth if isinstance(request.auth, ApiToken) else None
    if maker is None or maker.expires_at is None or wanted <= maker.expires_at:
        return wanted
    if days is None:
        return maker.expires_at  # the default, cut to the maker's own life
    left = max(0, (maker.expires_at - now).days)
    raise serializers.ValidationError(
        {
            "expires_in_days": [
                f"A token cannot outlive the token that makes it: yours expires in {left} day(s). Ask for at "
                f"most {left}, or sign in (the web page's session) to make a longer one."
            ]
        }
    )


class TokenListCreateView(APIView):
    parser_classes = [throttling.SubmitJSONParser]  # JSON only

    @extend_schema(responses={200: ApiTokenSerializer(many=True), **error_responses()})
    def get(self, request: Request) -> Response:
        """Your tokens that are not revoked, newest first (expired ones show `state: expired`)."""
        return Response(ApiTokenSerializer(selectors.api_tokens_of(request.user), many=True).data)

    @extend_schema(
        request=ApiTokenCreateSerializer,
        responses={
            201: OpenApiResponse(ApiTokenCreatedSerializer, description="made: `key` is shown this once"),
            **error_responses(
                400,
                413,
                415,
                s400="field errors, an expiry past the token the request came with, or "
                "too many live tokens (revoke some)",
            ),
        },
    )
    def post(self, request: Request) -> Response:
        """Make a token for yourself; its key is in this answer only."""
        incoming = ApiTokenCreateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        expires_at = _expiry(request, incoming.validated_data.get("expires_in_days"))
        try:
            token, key = tokens.issue(request.user, incoming.validated_data["name"], expires_at)
        except tokens.TooManyTokens as refused:
            return Response({"non_field_errors": [str(refused)]}, status=status.HTTP_400_BAD_REQUEST)
        body = ApiTokenSerializer(token).data | {"key": key}
        return Response(body, status=status.HTTP_201_CREATED)


class TokenDetailView(APIView):
    @extend_schema(responses={204: None, **error_responses(404, s404="no such token of yours (or revoked)")})
    def delete(self, request: Request, token_id: int) -> Response:
        """Revoke one of your tokens: it is refused (401) from now on, this request's own token included."""
        token = get_object_or_404(selectors.api_tokens_of(request.user), pk=token_id)
        tokens.revoke(token)
        return Response(status=status.HTTP_204_NO_CONTENT)
