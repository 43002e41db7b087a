"""OpenAPI annotations shared by the views: one error body, the statuses each operation can answer, the model enum.

A client generated from /api/schema/ (openapi-generator, openapi-python-client)
must be able to decode every answer, so each operation lists every status it
can send with its body schema, and the error bodies have one shape.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension, OpenApiSerializerFieldExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers

from genserver import deployment
from genserver.jobs.api.fields import StrictCharField, StrictIntegerField


class ErrorSerializer(serializers.Serializer):
    """Every 4xx/5xx body of /api/v1/: `detail` (and `reason`) for refusals, field names → messages for a 400."""

    detail = serializers.CharField(required=False, help_text="what went wrong and what to change")
    reason = serializers.CharField(
        required=False,
        help_text="a stable code: overloaded, too_many_in_flight, start_deadline, rate_limited, "
        "card_seconds_per_day, model_not_allowed, lane_not_allowed, exceeds_daily_quota, too_large, "
        "idempotency_conflict, unavailable, staff_only, finished, or why a step change was refused. A quota "
        "refusal also names `limit`, `used` and `resets_at` (429), or `allowed` (403: the models or lanes "
        "allowed); a 400 on a field of the same name is that field's messages instead",
    )
    retry_after = serializers.IntegerField(required=False, help_text="seconds; also in the Retry-After header")
    expected_start_at = serializers.DateTimeField(
        required=False,
        allow_null=True,
        help_text="reason start_deadline: the quote, when the job would be expected to start "
        "(null: no live card serves its queue)",
    )
    expected_finish_at = serializers.DateTimeField(
        required=False, allow_null=True, help_text="reason start_deadline: when its denoising would be expected to end"
    )
    non_field_errors = serializers.ListField(child=serializers.CharField(), required=False)

    class Meta:
        # A 400 names each bad field as a key with a list of messages: the object is open.
        ref_name = "Error"


_WHY = {
    400: "field errors: each bad field (or `non_field_errors`) with a list of messages",
    403: "staff only: a signed-in user who is not staff",
    401: "no token, or an unknown, expired or revoked one: send `Authorization: Token <key>` (or `Bearer <key>`)",
    404: "no such job of yours (another user's job is a 404 too), or the file is gone",
    409: "the job is in a state that refuses this; see `reason`",
    413: "the request body is too large; see `limit_bytes`",
    415: "the body is not JSON: send Content-Type: application/json",
    422: "the Idempotency-Key was used for a different request",
    429: "overloaded, too many jobs in flight, the expected start later than `start_within` (the body "
    "carries the quote: expected_start_at, expected_finish_at), or submitting too fast; see Retry-After "
    "and `reason`",
    503: "the database or the broker is unavailable; retry after Retry-After",
}


def error_responses(*statuses: int, **described: str) -> dict[int, OpenApiResponse]:
    """`{status: OpenApiResponse(ErrorSerializer)}` for 401 and 503 (every operation) plus `statuses`.

    `described` overrides a status's description, keyed `s409="..."`.
    """
    wanted = sorted({401, 503, *statuses})
    return {
        code: OpenApiResponse(ErrorSerializer, description=described.get(f"s{code}", _WHY[code])) for code in wanted
    }


class RegistryModelField(StrictCharField):
    """A model name of the registry; the schema lists the names as an enum (read when the schema is built)."""

    def __init__(self, kind: str = "", **kwargs: Any) -> None:
        self.kind = kind  # "image" or "video" narrows the enum; "" lists every model
        super().__init__(**kwargs)

    def names(self) -> list[str]:
        reg = deployment.registry()
        return [n for n in reg.names() if not self.kind or reg.get(n).kind == self.kind]


class RegistryModelFieldExtension(OpenApiSerializerFieldExtension):
    target_class = RegistryModelField

    def map_serializer_field(self, auto_schema, direction) -> dict[str, Any]:
        return {"type": "string", "enum": self.target.names()}


class NumOutputsField(StrictIntegerField):
    """Outputs of one job: at least 1, at most its model's `max_batch` (checked against the model in
    the serializer's validate); the schema's maximum is the largest `max_batch` of the registry."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("min_value", 1)
        kwargs.setdefault("required", False)
        kwargs.setdefault("default", 1)
        kwargs.setdefault("help_text", "outputs to make: at most the model's limits.max_outputs (GET /api/v1/models/)")
        super().__init__(**kwargs)

    @staticmethod
    def largest() -> int:
        reg = deployment.registry()
        return max(reg.get(n).max_batch for n in reg.names())


class NumOutputsFieldExtension(OpenApiSerializerFieldExtension):
    target_class = NumOutputsField

    def map_serializer_field(self, auto_schema, direction) -> dict[str, Any]:
        return {"type": "integer", "minimum": 1, "maximum": self.target.largest()}


class BearerScheme(OpenApiAuthenticationExtension):
    """The Bearer keyword gets its own security scheme (DRF's Token one is `tokenAuth`)."""

    target_class = "genserver.jobs.api.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema) -> dict[str, Any]:
        return build_bearer_security_scheme_object(header_name="Authorization", token_prefix="Bearer")


class LimitsSerializer(serializers.Serializer):
    min_size = serializers.IntegerField()
    max_width = serializers.IntegerField()
    max_height = serializers.IntegerField()
    size_multiple = serializers.IntegerField()
    max_frames = serializers.IntegerField()
    frames_step = serializers.IntegerField()
    max_steps = serializers.IntegerField()
    max_prompt_chars = serializers.IntegerField()
    max_guidance = serializers.FloatField()
    max_outputs = serializers.IntegerField()


class DefaultsSerializer(serializers.Serializer):
    width = serializers.IntegerField()
    height = serializers.IntegerField()
    num_frames = serializers.IntegerField()
    steps = serializers.IntegerField()
    guidance_scale = serializers.FloatField()


class ModelInfoSerializer(serializers.Serializer):
    """One entry of GET /api/v1/models/ (the registry's public view of a model)."""

    name = serializers.CharField()
    family = serializers.CharField()
    kind = serializers.ChoiceField(choices=["image", "video"])
    backend = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    limits = LimitsSerializer()
    defaults = DefaultsSerializer()
    segment_frames = serializers.IntegerField()
    max_merge = serializers.IntegerField()
    step_time_correction = serializers.DictField(
        child=serializers.FloatField(),
        help_text="the learned factor (measured / modelled step seconds) the ETAs of this model use, by shape "
        "bucket (`family:log2(tokens)`); {} until a chunk of it was measured (simulated models never learn)",
    )


class QueueInfoSerializer(serializers.Serializer):
    """One duration class of GET /api/v1/queues/ (the fields marked "staff only" are absent for others)."""

    name = serializers.ChoiceField(choices=["short", "medium", "long"])
    depth = serializers.IntegerField(help_text="jobs of the class waiting")
    running = serializers.IntegerField()
    backlog_seconds = serializers.FloatField()
    capacity_source = serializers.ChoiceField(
        choices=["live", "layout"], help_text="live: cards counted from heartbeats; layout: from the configured layout"
    )
    cards = serializers.IntegerField(help_text="cards serving the class")
    expected_wait_seconds = serializers.FloatField(allow_null=True, help_text="null: no worker serves the class")
    wait_limit_seconds = serializers.FloatField()
    accepting = serializers.BooleanField()
    capped = serializers.BooleanField(
        help_text="the overload cap holds: under a long backlog at most N-1 cards run long work, and `cards` "
        "counts those (long class only; always false for the others)"
    )
    workers = serializers.ListField(
        child=serializers.CharField(), required=False, help_text="staff only: workers of the layout serving it"
    )
    cards_by_node = serializers.DictField(
        child=serializers.IntegerField(), required=False, help_text="staff only: the cards serving it, per node"
    )
    live_workers = serializers.ListField(
        child=serializers.CharField(), required=False, help_text="staff only: live workers serving it"
    )
    broker_messages = serializers.IntegerField(
        required=False, allow_null=True, help_text="staff only: messages waiting in its broker queues"
    )


class QuotaLimitSerializer(serializers.Serializer):
    limit = serializers.FloatField(allow_null=True, help_text="null: no limit")
    used = serializers.FloatField()
    remaining = serializers.FloatField(allow_null=True, help_text="null: no limit")
    resets_at = serializers.DateTimeField(allow_null=True, help_text="when a place frees up / the count resets")


class SubmitRateLimitSerializer(QuotaLimitSerializer):
    window_seconds = serializers.FloatField(help_text="the rate window (GENSERVER_SUBMIT_RATE_WINDOW, 60 s)")


class UsageSerializer(serializers.Serializer):
    """GET /api/v1/usage/: the caller's own counts against their quota."""

    user = serializers.CharField()
    quota = serializers.CharField(help_text='where the limits come from: "user", "groups: ...", or "default"')
    jobs_in_flight = QuotaLimitSerializer(help_text="unfinished jobs (resets_at null: places free up as jobs end)")
    submits_per_minute = SubmitRateLimitSerializer(help_text="accepted submits in the rate window")
    card_seconds_per_day = QuotaLimitSerializer(
        help_text="card time today (UTC): running jobs at their estimate, ended ones at their measured time; "
        "resets at 00:00 UTC"
    )
    allowed_models = serializers.ListField(child=serializers.CharField())
    allowed_lanes = serializers.ListField(
        child=serializers.CharField(),
        allow_null=True,
        help_text="null: every lane (a job without a lane is always allowed)",
    )


class PromptField(StrictCharField):
    """A prompt: text with at least one non-blank character (it is trimmed)."""


class PromptFieldExtension(OpenApiSerializerFieldExtension):
    target_class = PromptField

    def map_serializer_field(self, auto_schema, direction) -> dict[str, Any]:
        return {"type": "string", "minLength": 1, "maxLength": self.target.max_length or 20000, "pattern": r"\S"}


# Request bodies whose unknown fields are refused (400): the schema says so, so generated clients and
# schemathesis do not send extras.
CLOSED_REQUEST_BODIES = (
    "JobCreateRequest",
    "StepsChangeRequest",
    "ImageGenerationRequestRequest",
    "JobCreate",
    "StepsChange",
    "ImageGenerationRequest",
    "ApiTokenCreateRequest",
    "ApiTokenCreate",
)


def close_request_bodies(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: `additionalProperties: false` on the request bodies above."""
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name in CLOSED_REQUEST_BODIES:
            component["additionalProperties"] = False
    return result


EVENTS_PATH = "/api/v1/jobs/{job_id}/events/"


def document_event_stream(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: GET /api/v1/jobs/{job_id}/events/, an async Django view outside DRF
    (genserver/jobs/api/events.py) that drf-spectacular does not see, with the job detail's tags and security."""
    paths = result.setdefault("paths", {})
    detail = paths.get("/api/v1/jobs/{job_id}/", {}).get("get", {})
    error = {"$ref": "#/components/schemas/Error"}

    def failure(code: int) -> dict[str, Any]:
        return {"description": _WHY[code], "content": {"application/json": {"schema": error}}}

    paths[EVENTS_PATH] = {
        "get": {
            "operationId": "jobs_events_retrieve",
            "summary": "The job's server-sent events",
            "description": "`text/event-stream`: an event at every change a client cares about (status and stage, "
            "queue position and ETA, progress, a preview, outputs, an error); each event's `data:` is the job as "
            "GET /api/v1/jobs/{job_id}/ shows it and its `id:` resumes the stream when sent back as `Last-Event-ID`. "
            "The stream ends after the terminal event (succeeded, failed, cancelled, expired). Owner and staff only.",
            "parameters": [
                {"in": "path", "name": "job_id", "required": True, "schema": {"type": "string", "format": "uuid"}},
                {
                    "in": "header",
                    "name": "Last-Event-ID",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "the `id:` of the last event received: the stream replays what came after it",
                },
            ],
            "tags": detail.get("tags", ["jobs"]),
            "security": detail.get("security", []),
            "responses": {
                "200": {
                    "description": "the event stream: `retry:`, then `id:` and `data:` (the job's JSON) per event, "
                    "`: keepalive` comments while idle",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                "204": {
                    "description": "the Last-Event-ID is the job's terminal event: nothing follows (an "
                    "EventSource stops reconnecting)"
                },
                "401": failure(401),
                "404": failure(404),
            },
        }
    }
    return result
