"""The OpenAI Images API shape over ordinary jobs: POST /v1/images/generations and GET /v1/models.

A generation request is translated into a native job request and goes through
the same validation, admission, classes and limits as POST /api/v1/jobs/. The
view then waits for the job (at most GENSERVER_OPENAI_WAIT_SECONDS) and answers
OpenAI's response shape, or OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`:

* 400 bad fields (`param` names the OpenAI field), 401 no or unknown token,
  403 a model the user's quota does not allow, 413 body too large, 415 not JSON,
  429 with Retry-After when admission or a limit of the user's quota refuses
  (`code`: overloaded, too_many_in_flight, rate_limited, card_seconds_per_day);
* a job that ends failed answers 500, one cancelled 409 (both name the job);
  neither is retried by the OpenAI client (`x-should-retry: false`): a retry
  would be a new job;
* when the wait ends first: 202 with `data: []` and an error naming the job
  (`job_id`, Location), which keeps running: poll GET /api/v1/jobs/{id}/.

A `url` answer is delivered as the native API delivers outputs: the output
endpoint's URL (GET it with the same Authorization header: it checks the
owner), or with GENSERVER_OUTPUT_DELIVERY=presigned on object storage the
short-lived presigned URL that endpoint would redirect to.

Over 400 lines because it is a whole API of its own: the request translation, every error mapped to
OpenAI's shape, the bounded wait and the two response formats, kept together so the mapping reads in one place.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.reverse import reverse
from rest_framework.views import APIView

from genserver import deployment
from genserver.jobs import selectors, services
from genserver.jobs.api import throttling
from genserver.jobs.api.auth import ApiTokenAuthentication, BearerTokenAuthentication
from genserver.jobs.api.fields import (
    StrictCharField,
    StrictChoiceField,
    StrictFloatField,
    StrictIntegerField,
    StrictRegexField,
)
from genserver.jobs.api.schema import NumOutputsField, PromptField, RegistryModelField
from genserver.jobs.api.serializers import JobCreateSerializer
from genserver.jobs.models import Job, JobStatus
from genserver.storage import StorageError, default_storage

_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
# A native field's error is reported under the OpenAI field it came from.
_PARAM_OF = {
    "width": "size",
    "height": "size",
    "num_outputs": "n",
    "steps": "num_inference_steps",
    "num_frames": "model",
}
_NO_RETRY = {"x-should-retry": "false"}  # the OpenAI client would otherwise resubmit: a second job


# --- Request and response shapes --------------------------------------------------------------
class ImageGenerationRequestSerializer(serializers.Serializer):
    """OpenAI's images.generate body, plus the diffusion fields OpenAI lacks (extensions)."""

    prompt = PromptField(max_length=20000)
    model = RegistryModelField(kind="image", max_length=100, help_text="an image model of GET /v1/models")
    n = NumOutputsField(help_text="images to make (the job's num_outputs): at most the model's max_outputs")
    size = StrictRegexField(
        r"^(auto|\d{1,5}x\d{1,5})$",
        required=False,
        default="auto",
        max_length=16,
        error_messages={"invalid": 'Give "WIDTHxHEIGHT" (e.g. "512x512") or "auto".'},
        help_text='"WIDTHxHEIGHT" within the model\'s limits, or "auto" (its default)',
    )
    response_format = StrictChoiceField(choices=["url", "b64_json"], required=False, default="url")
    output_format = StrictChoiceField(choices=["png"], required=False, default="png")
    user = StrictCharField(
        required=False, max_length=256, allow_blank=True, help_text="your end user's id (accepted, not stored)"
    )
    quality = StrictCharField(required=False, max_length=32, help_text="accepted and ignored")
    style = StrictCharField(required=False, max_length=32, help_text="accepted and ignored")
    negative_prompt = StrictCharField(required=False, max_length=20000, allow_blank=True)
    seed = StrictIntegerField(required=False, min_value=0, max_value=2**63 - 1)
    num_inference_steps = StrictIntegerField(required=False, min_value=1, max_value=10000)
    guidance_scale = StrictFloatField(required=False, min_value=0.0, max_value=1000.0)

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["Send a JSON object of image request fields."]})
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({k: ["Unknown field."] for k in unknown})
        return super().to_internal_value(data)

    def validate_model(self, value: str) -> str:
        names = self.fields["model"].names()
        if value not in names:
            raise serializers.ValidationError(f"Unknown image model {value!r}; available: {', '.join(names)}.")
        return value

    def native(self) -> dict[str, Any]:
        """The native job request this OpenAI request stands for."""
        data = self.validated_data
        job: dict[str, Any] = {"model": data["model"], "prompt": data["prompt"], "num_outputs": data["n"]}
        if data["size"] != "auto":
            width, height = _SIZE.match(data["size"]).groups()  # type: ignore[union-attr] - validated
            job |= {"width": int(width), "height": int(height)}
        for ours, theirs in (
            ("negative_prompt", "negative_prompt"),
            ("seed", "seed"),
            ("steps", "num_inference_steps"),
            ("guidance_scale", "guidance_scale"),
        ):
            if theirs in data:
                job[ours] = data[theirs]
        return job


class ImageDataSerializer(serializers.Serializer):
    url = serializers.URLField(
        required=False,
        help_text="GET it with the same Authorization header; with GENSERVER_OUTPUT_DELIVERY=presigned on "
        "object storage, a short-lived presigned URL of the store instead (no header needed)",
    )
    b64_json = serializers.CharField(required=False, help_text="the PNG, base64")
    revised_prompt = serializers.CharField(required=False)


class ImagesResponseSerializer(serializers.Serializer):
    created = serializers.IntegerField(help_text="Unix seconds when the job was submitted")
    data = ImageDataSerializer(many=True)
    job_id = serializers.UUIDField(help_text="the native job (GET /api/v1/jobs/{id}/)")


class OpenAIErrorDetailSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)
    job_id = serializers.UUIDField(required=False, help_text="the job, where one exists (poll it)")


class OpenAIErrorSerializer(serializers.Serializer):
    error = OpenAIErrorDetailSerializer()


class PendingImagesSerializer(ImagesResponseSerializer):
    error = OpenAIErrorDetailSerializer()


class OpenAIModelSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["model"])
    created = serializers.IntegerField()
    owned_by = serializers.CharField()


class OpenAIModelListSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=["list"])
    data = OpenAIModelSerializer(many=True)


def _error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
    why = {
        400: "bad fields (`param` names the field)",
        401: "no token, or an unknown one",
        409: "the job was cancelled before it finished",
        413: "the request body is too large",
        422: "the Idempotency-Key was used for a different request",
        415: "the body is not JSON",
        403: "your quota does not allow this model (`code` model_not_allowed), or the job alone costs more "
        "card-seconds than your daily quota (exceeds_daily_quota)",
        429: "refused: overloaded, or a limit of your quota: too many jobs in flight, too fast, card-seconds "
        "per day (`code` names it; Retry-After)",
        500: "the job failed (`job_id` names it)",
        503: "the database or the broker is unavailable",
    }
    return {code: OpenApiResponse(OpenAIErrorSerializer, description=why[code]) for code in statuses}


# --- Errors in OpenAI's shape -------------------------------------------------------------------
def openai_error(
    http_status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> Response:
    return Response(
        {"error": {"message": message, "type": type_, "param": param, "code": code} | extra},
        status=http_status,
        headers=headers,
    )


def _first_field_error(detail: Any, prefix: str = "") -> tuple[str | None, str]:
    """(param, message) of the first error in DRF's nested ValidationError detail."""
    if isinstance(detail, dict):
        for field, inner in detail.items():
            param, message = _first_field_error(inner)
            if field in ("non_field_errors", "detail"):
                return param, message
            name = _PARAM_OF.get(field, field)
            return name, f"{name}: {message}"
    if isinstance(detail, list) and detail:
        return _first_field_error(detail[0])
    return None, str(detail)


class OpenAIView(APIView):
    """Bearer first (its 401 carries `WWW-Authenticate: Bearer`), and every error in OpenAI's shape."""

    authentication_classes = [BearerTokenAuthentication, ApiTokenAuthentication]

    def handle_exception(self, exc: Exception) -> Response:
        response = super().handle_exception(exc)
        if isinstance(getattr(response, "data", None), dict) and "error" in response.data:
            return response  # already in OpenAI's shape
        data, code = response.data, response.status_code
        reason = data.get("reason") if isinstance(data, dict) else None
        if isinstance(exc, exceptions.ValidationError) or code == status.HTTP_400_BAD_REQUEST:
            param, message = _first_field_error(data)
            body = openai_error(code, message, "invalid_request_error", param, "invalid_value").data
        elif code in (status.HTTP_401_UNAUTHORIZED, status.HTTP_403_FORBIDDEN):
            message = (
                "Incorrect or missing API key: send `Authorization: Bearer <token>` with a "
                "token from `manage.py issue_token USER` or POST /api/v1/tokens/."
            )
            if isinstance(exc, exceptions.AuthenticationFailed) and str(exc.detail) != "Invalid token.":
                message = str(exc.detail)  # an expired or revoked token says so, and what to do
            body = openai_error(
                code,
                message,
                "invalid_request_error",
                None,
                "invalid_api_key",
            ).data
        elif code == status.HTTP_429_TOO_MANY_REQUESTS:
            body = openai_error(code, _detail(data), "rate_limit_error", None, reason or "rate_limit_exceeded").data
        elif code >= 500:
            body = openai_error(code, _detail(data), "server_error", None, reason).data
        else:
            body = openai_error(code, _detail(data), "invalid_request_error", None, reason).data
        response.data = body
        return response


def _detail(data: Any) -> str:
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])
    return str(data)


# --- Views ---------------------------------------------------------------------------------------
class ImageGenerationView(OpenAIView):
    parser_classes = [throttling.SubmitJSONParser]

    @extend_schema(
        operation_id="openai_images_generate",
        tags=["openai"],
        request=ImageGenerationRequestSerializer,
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                str,
                OpenApiParameter.HEADER,
                description="a retry with the same key waits on the first job",
            )
        ],
        responses={
            200: ImagesResponseSerializer,
            202: OpenApiResponse(
                PendingImagesSerializer,
                description="the wait ended first: `data` is "
                "empty and `error.job_id` names the job, which keeps running",
            ),
            **_error_responses(400, 401, 403, 409, 413, 415, 422, 429, 500, 503),
        },
    )
    def post(self, request: Request) -> Response:
        """Make images (the OpenAI Images API): an ordinary job, waited for up to GENSERVER_OPENAI_WAIT_SECONDS."""
        # 1. Validate the OpenAI shape, then the native job request (registry limits).
        throttling.check_body_size(request)
        incoming = ImageGenerationRequestSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        native = JobCreateSerializer(data=incoming.native())
        native.is_valid(raise_exception=True)
        # 2. Submit through the job service: admission, classes and limits as for any job.
        key = request.headers.get("Idempotency-Key", "").strip()
        if len(key) > 200:
            return openai_error(
                400,
                "Idempotency-Key: at most 200 characters.",
                "invalid_request_error",
                "Idempotency-Key",
                "invalid_value",
            )
        try:
            job, replayed, _ = services.submit_or_replay(request.user, native.validated_data, key)
        except services.IdempotencyConflict as conflict:
            return openai_error(422, str(conflict), "invalid_request_error", "Idempotency-Key", "idempotency_conflict")
        except services.QuotaExceeded as full:
            return openai_error(
                429,
                str(full),
                "rate_limit_error",
                None,
                full.reason,  # too_many_in_flight, rate_limited or card_seconds_per_day
                headers={"Retry-After": str(full.retry_after_seconds)},
            )
        except services.NotAllowed as refused:
            return openai_error(
                403,
                str(refused),
                "permission_error",
                _PARAM_OF.get(refused.field, refused.field),
                refused.reason,  # model_not_allowed or exceeds_daily_quota (the endpoint has no lane)
            )
        except services.AdmissionRefused as refused:
            d = refused.decision
            return openai_error(
                429,
                d.reason,
                "rate_limit_error",
                None,
                "overloaded",
                headers={"Retry-After": str(d.retry_after_seconds)},
            )
        # 3. Wait for it (bounded), then answer the images or what became of the job.
        job = selectors.wait_for_terminal(job.pk, settings.OPENAI_WAIT_SECONDS)
        response = self._answer(request, job, incoming.validated_data["response_format"])
        if replayed:  # the first request's job, as on POST /api/v1/jobs/: a retry made no new one
            response["Idempotent-Replayed"] = "true"
        return response

    def _answer(self, request: Request, job: Job, response_format: str) -> Response:
        created = int(job.created_at.timestamp())
        where = reverse("job-detail", args=[job.pk], request=request)
        if job.status == JobStatus.SUCCEEDED:
            data = [self._image(request, job, i, response_format) for i in range(len(job.outputs))]
            if None not in data:
                return Response({"created": created, "data": data, "job_id": str(job.pk)})
            return openai_error(
                500,
                f"The outputs of job {job.pk} are no longer stored.",
                "server_error",
                None,
                "output_gone",
                headers=_NO_RETRY,
                job_id=str(job.pk),
            )
        if job.status == JobStatus.CANCELLED:
            return openai_error(
                409,
                f"Job {job.pk} was cancelled before it finished.",
                "invalid_request_error",
                None,
                "job_cancelled",
                headers=_NO_RETRY,
                job_id=str(job.pk),
            )
        if job.is_terminal:
            return openai_error(
                500,
                f"Job {job.pk} {job.status}: {job.error or 'no error recorded'}",
                "server_error",
                None,
                f"job_{job.status}",
                headers=_NO_RETRY,
                job_id=str(job.pk),
            )
        message = (
            f"Job {job.pk} did not finish within {settings.OPENAI_WAIT_SECONDS:g} s; it keeps running "
            f"({job.status}): poll GET {where} and download its outputs from there."
        )
        return Response(
            {
                "created": created,
                "data": [],
                "job_id": str(job.pk),
                "error": {
                    "message": message,
                    "type": "timeout",
                    "param": None,
                    "code": "job_pending",
                    "job_id": str(job.pk),
                },
            },
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": where} | _NO_RETRY,
        )

    @staticmethod
    def _output_url(request: Request, job: Job, index: int) -> str | None:
        """As the native API delivers the output: with GENSERVER_OUTPUT_DELIVERY=presigned on object storage,
        the same short-lived presigned URL (OUTPUT_URL_TTL_SECONDS) its output endpoint redirects to; else
        that endpoint's URL, which checks the owner. None: the object is no longer stored."""
        api_url = reverse("job-output", args=[job.pk, index], request=request)
        if settings.OUTPUT_DELIVERY != "presigned":
            return api_url
        out = job.outputs[index]
        storage = default_storage()
        try:
            signed = storage.presigned_url(out["key"], settings.OUTPUT_URL_TTL_SECONDS, out["content_type"])
            if signed is not None and not storage.exists(out["key"]):  # signing asks the store nothing
                return None
        except StorageError:
            return None
        return signed or api_url  # None: a backend without URLs of its own (local) streams through the API

    @staticmethod
    def _image(request: Request, job: Job, index: int, response_format: str) -> dict[str, str] | None:
        if response_format == "url":
            url = ImageGenerationView._output_url(request, job, index)
            return {"url": url} if url is not None else None
        try:
            return {"b64_json": base64.b64encode(default_storage().get(job.outputs[index]["key"])).decode("ascii")}
        except (OSError, StorageError):
            return None


class OpenAIModelListView(OpenAIView):
    @extend_schema(
        operation_id="openai_models_list",
        tags=["openai"],
        responses={200: OpenAIModelListSerializer, **_error_responses(401, 503)},
    )
    def get(self, request: Request) -> Response:
        """The image models, in OpenAI's list shape (video models are on GET /api/v1/models/)."""
        reg = deployment.registry()
        names = [n for n in reg.names() if reg.get(n).kind == "image"]
        return Response(
            {
                "object": "list",
                "data": [{"id": n, "object": "model", "created": 0, "owned_by": "genserver"} for n in names],
            }
        )
