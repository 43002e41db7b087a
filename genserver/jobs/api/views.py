"""One thin view per endpoint: parse, call a service or selector, render.

Over 400 lines because it holds every native endpoint's view (about twenty) and their small shared
helpers (the job context, Prefer: wait); each view is a few lines, and splitting them by endpoint would
scatter the helpers. The other APIs have their own modules (openai_images, events, tokens).
"""

from __future__ import annotations

import math

from django.conf import settings
from django.http import FileResponse, Http404, HttpResponseRedirect
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from genserver import deployment
from genserver.jobs import selectors, services
from genserver.jobs.api import throttling, waits
from genserver.jobs.api.schema import ModelInfoSerializer, QueueInfoSerializer, UsageSerializer, error_responses
from genserver.jobs.api.serializers import (
    JobCreateSerializer,
    JobSerializer,
    PriorityChangeSerializer,
    StepsChangeSerializer,
)
from genserver.jobs.models import JobStatus
from genserver.storage import StorageError, default_storage


class StrictLimitOffsetPagination(LimitOffsetPagination):
    """`limit` and `offset` as the schema declares them: a value that is not a whole number ≥ 0 is a 400.

    DRF's own pagination falls back to its defaults on a bad value, which hides a client's bug.
    """

    def _strict(self, request: Request, name: str) -> None:
        raw = request.query_params.get(name)
        if raw is not None and not (raw.isascii() and raw.isdigit()):
            raise ValidationError({name: ["A whole number ≥ 0 is required."]})

    def paginate_queryset(self, queryset, request, view=None):
        self._strict(request, self.limit_query_param)
        self._strict(request, self.offset_query_param)
        return super().paginate_queryset(queryset, request, view)


def _job_context(request: Request, jobs: list | None = None, snapshot: selectors.QueueSnapshot | None = None) -> dict:
    snapshot = snapshot or selectors.QueueSnapshot.load()
    if jobs:
        snapshot.prepare(jobs)  # a page's positions and ETAs in one query
    return {"request": request, "snapshot": snapshot}


class JobListCreateView(GenericAPIView):
    serializer_class = JobSerializer
    pagination_class = StrictLimitOffsetPagination
    parser_classes = [throttling.SubmitJSONParser]  # JSON only: any other content type is a 415

    def get_queryset(self):
        qs = selectors.jobs_listed_for(self.request.user).select_related("owner").prefetch_related("segments")
        wanted = self.request.query_params.get("status")
        if wanted:
            if wanted not in JobStatus.values:
                from rest_framework.exceptions import ValidationError

                raise ValidationError({"status": [f"Must be one of {', '.join(JobStatus.values)}."]})
            qs = qs.filter(status=wanted)
        return qs

    @extend_schema(
        parameters=[OpenApiParameter("status", OpenApiTypes.STR, enum=JobStatus.values)],
        responses={200: JobSerializer(many=True), **error_responses(400)},
    )
    def get(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        data = JobSerializer(page, many=True, context=_job_context(request, page)).data
        return self.get_paginated_response(data)

    @extend_schema(
        request=JobCreateSerializer,
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                description="retrying a submit with the same key returns the first job (200) instead of a new one",
            ),
            OpenApiParameter(
                "Prefer",
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,  # RFC 7240: any text; unknown ignored
                description="`wait=N`: hold the answer until the job ends or N seconds pass (N is cut "
                "to GENSERVER_PREFER_WAIT_MAX_SECONDS); a job that ended is answered with "
                "`Preference-Applied: wait=N`, otherwise the usual 201 without it",
            ),
        ],
        responses={
            201: OpenApiResponse(JobSerializer, description="the job; finished when `Preference-Applied` is present"),
            200: OpenApiResponse(JobSerializer, description="a retry with the same Idempotency-Key"),
            **error_responses(
                400,
                403,
                413,
                415,
                422,
                429,
                s403="your quota does not allow this model or lane (`allowed` lists those it does), or the "
                "job alone costs more card-seconds than your daily quota; nothing was recorded",
                s429="overloaded, a limit of your quota (jobs in flight, submits per minute, card-seconds "
                "per day: `limit`, `used`, `resets_at`; see GET /api/v1/usage/), or (reason "
                "`start_deadline`) the expected start is later than `start_within`: the body carries the "
                "quote (expected_start_at, expected_finish_at); see Retry-After. Nothing was recorded",
            ),
        },
    )
    def post(self, request: Request) -> Response:
        throttling.check_body_size(request)
        incoming = JobCreateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key", "").strip()
        if len(key) > 200:
            return Response({"Idempotency-Key": ["At most 200 characters."]}, status=status.HTTP_400_BAD_REQUEST)
        try:
            job, replayed, snapshot = services.submit_or_replay(request.user, incoming.validated_data, key)
        except services.IdempotencyConflict as conflict:
            return Response(
                {"detail": str(conflict), "reason": "idempotency_conflict"}, status=status.HTTP_422_UNPROCESSABLE_ENTITY
            )
        except services.QuotaExceeded as full:
            return _quota_exceeded(full)
        except services.NotAllowed as refused:
            return _not_allowed(refused)
        except services.AdmissionRefused as refused:
            return _overloaded(refused)
        except services.StartDeadlineRefused as late:
            return _too_late(late)
        headers = {"Idempotent-Replayed": "true"} if replayed else {}
        wait = waits.preferred_wait(request)
        if wait is not None:
            job = selectors.wait_for_terminal(job.pk, wait)
            snapshot = None  # the queue moved while it waited
            if job.is_terminal:
                headers["Preference-Applied"] = f"wait={wait}"
        body = JobSerializer(job, context=_job_context(request, snapshot=snapshot)).data
        return Response(body, status=status.HTTP_200_OK if replayed else status.HTTP_201_CREATED, headers=headers)


class JobDetailView(APIView):
    @extend_schema(responses={200: JobSerializer, **error_responses(404)})
    def get(self, request: Request, job_id) -> Response:
        # The owner in the same statement: the answer names it, and clients poll this route.
        job = get_object_or_404(selectors.jobs_visible_to(request.user).select_related("owner"), pk=job_id)
        return Response(JobSerializer(job, context=_job_context(request)).data)


class JobCancelView(APIView):
    @extend_schema(request=None, responses={202: JobSerializer, **error_responses(404)})
    def post(self, request: Request, job_id) -> Response:
        job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
        job = services.cancel_job(job)
        return Response(JobSerializer(job, context=_job_context(request)).data, status=status.HTTP_202_ACCEPTED)


class JobStepsView(APIView):
    parser_classes = [throttling.SubmitJSONParser]  # JSON only

    @extend_schema(
        request=StepsChangeSerializer,
        responses={
            202: OpenApiResponse(
                JobSerializer,
                description="accepted: `steps` is the new total (a running job takes it "
                "up at its next step; one stopped early then shows the "
                "steps it did), `steps_requested` the total asked at submit",
            ),
            **error_responses(
                400,
                404,
                409,
                413,
                415,
                429,
                s409="the job is decoding, finished or being cancelled; see `reason`",
                s429="the added work is refused by admission (class overloaded); "
                "see Retry-After and `reason`; nothing changed",
            ),
        },
    )
    def post(self, request: Request, job_id) -> Response:
        """Change the step count midway: fewer stops early (decoding the current x0 estimate), more continues."""
        job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
        incoming = StepsChangeSerializer(data=request.data, context={"model": job.model})
        incoming.is_valid(raise_exception=True)
        try:
            job = services.change_steps(job, incoming.validated_data["steps"])
        except services.StepsChangeRefused as refused:
            return Response(
                {"detail": str(refused), "reason": refused.reason, "status": refused.status},
                status=status.HTTP_409_CONFLICT,
            )
        except services.AdmissionRefused as refused:
            return _overloaded(refused)
        return Response(JobSerializer(job, context=_job_context(request)).data, status=status.HTTP_202_ACCEPTED)


class JobPriorityView(APIView):
    parser_classes = [throttling.SubmitJSONParser]  # JSON only

    @extend_schema(
        request=PriorityChangeSerializer,
        responses={
            200: OpenApiResponse(
                JobSerializer,
                description="re-prioritised: `queue_position`, `eta_seconds` and the quote follow; a waiting "
                "message was re-published at the new priority (a held job takes it with its next message)",
            ),
            **error_responses(
                400,
                403,
                404,
                409,
                413,
                415,
                s400="`priority` missing, not a whole number, or outside the job's class band "
                "(short 0-3, medium 4-5, long 6-8: a job never moves across classes)",
                s409="the job has ended (succeeded, failed, cancelled or expired)",
            ),
        },
    )
    def post(self, request: Request, job_id) -> Response:
        """Staff: move a job within its class (the Redis priority of its next message, 0 first)."""
        if not request.user.is_staff:
            return Response(
                {"detail": "Only staff may re-prioritise jobs.", "reason": "staff_only"},
                status=status.HTTP_403_FORBIDDEN,
            )
        job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
        incoming = PriorityChangeSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        try:
            job = services.reprioritise(job, incoming.validated_data["priority"])
        except services.PriorityRefused as refused:
            if refused.reason == "out_of_band":
                return Response({"priority": [str(refused)]}, status=status.HTTP_400_BAD_REQUEST)
            job.refresh_from_db()
            return Response(
                {"detail": str(refused), "reason": refused.reason, "status": job.status},
                status=status.HTTP_409_CONFLICT,
            )
        return Response(JobSerializer(job, context=_job_context(request)).data)


def _too_late(late: services.StartDeadlineRefused) -> Response:
    """429 with Retry-After and the quote: the job would not start within the request's `start_within`."""
    field = serializers.DateTimeField()
    return Response(
        {
            "detail": str(late),
            "reason": "start_deadline",
            "start_within": late.start_within,
            "expected_start_at": field.to_representation(late.expected_start_at) if late.expected_start_at else None,
            "expected_finish_at": field.to_representation(late.expected_finish_at) if late.expected_finish_at else None,
            "retry_after": late.retry_after_seconds,
        },
        status=status.HTTP_429_TOO_MANY_REQUESTS,
        headers={"Retry-After": str(late.retry_after_seconds)},
    )


def _quota_exceeded(full: services.QuotaExceeded) -> Response:
    """429 with Retry-After: a limit of the user's quota (which, what is used, when it resets)."""
    body = {
        "detail": str(full),
        "reason": full.reason,
        "limit": full.limit,
        "used": full.used,
        "retry_after": full.retry_after_seconds,
        "resets_at": serializers.DateTimeField().to_representation(full.resets_at) if full.resets_at else None,
    }
    if isinstance(full, services.InFlightLimitReached):
        body["in_flight"] = full.in_flight
    if full.reason == "rate_limited":
        body["window_seconds"] = settings.SUBMIT_RATE_WINDOW
    return Response(
        body, status=status.HTTP_429_TOO_MANY_REQUESTS, headers={"Retry-After": str(full.retry_after_seconds)}
    )


def _not_allowed(refused: services.NotAllowed) -> Response:
    """403: the user's quota does not allow this model or lane (or a job this big); `allowed` lists what it does."""
    body: dict = {"detail": str(refused), "reason": refused.reason, refused.field: [str(refused)]}
    if refused.allowed is not None:
        body["allowed"] = refused.allowed
    return Response(body, status=status.HTTP_403_FORBIDDEN)


def _overloaded(refused: services.AdmissionRefused) -> Response:
    """429 with Retry-After for work admission refused (a submit, or steps added to a job)."""
    d = refused.decision
    return Response(
        {
            "detail": d.reason,
            "reason": "overloaded",
            "duration_class": refused.duration_class,
            # None: no live card serves the queue (every node with one is down)
            "expected_wait_seconds": (
                round(d.expected_wait_seconds, 1) if math.isfinite(d.expected_wait_seconds) else None
            ),
            "limit_seconds": d.limit_seconds,
            "retry_after": d.retry_after_seconds,
        },
        status=status.HTTP_429_TOO_MANY_REQUESTS,
        headers={"Retry-After": str(d.retry_after_seconds)},
    )


def _serve(key: str, content_type: str, *, delivery: str = "stream") -> HttpResponseBase:
    """The stored object `key`, after the caller's owner check: streamed through the API, or (`presigned`,
    on a backend that signs URLs) a 302 to a URL of the object store valid OUTPUT_URL_TTL_SECONDS."""
    storage = default_storage()
    try:
        if delivery == "presigned":
            url = storage.presigned_url(key, settings.OUTPUT_URL_TTL_SECONDS, content_type)
            if url is not None and not storage.exists(key):  # signing asks the store nothing: ask it here
                raise StorageError(f"storage key {key!r} does not exist")
            if url is not None:
                redirect = HttpResponseRedirect(url)
                redirect["Cache-Control"] = "private, no-store"  # the URL is a bearer credential until it expires
                return redirect
        stored = storage.open(key)
    except StorageError:
        raise Http404("that file is no longer stored") from None
    response = FileResponse(stored.stream, content_type=content_type)
    response["Content-Length"] = str(stored.size)
    return response


class JobOutputView(APIView):
    @extend_schema(
        responses={
            (200, "image/png"): OpenApiTypes.BINARY,
            302: OpenApiResponse(
                description="GENSERVER_OUTPUT_DELIVERY=presigned on object "
                "storage: Location is a short-lived URL of the output"
            ),
            **error_responses(404),
        }
    )
    def get(self, request: Request, job_id, index: int):
        job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
        if index >= len(job.outputs):
            raise Http404("no such output")
        out = job.outputs[index]
        return _serve(out["key"], out["content_type"], delivery=settings.OUTPUT_DELIVERY)


class JobPreviewView(APIView):
    @extend_schema(responses={(200, "image/png"): OpenApiTypes.BINARY, **error_responses(404)})
    def get(self, request: Request, job_id):
        job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
        if not job.preview_key:
            raise Http404("no preview yet")
        return _serve(job.preview_key, "image/png")


class JobSegmentView(APIView):
    """A published segment of a long video: its MP4 clip, or (`poster`) its first frame."""

    poster = False

    @extend_schema(
        responses={
            (200, "video/mp4"): OpenApiTypes.BINARY,
            (200, "image/png"): OpenApiTypes.BINARY,
            **error_responses(404),
        }
    )
    def get(self, request: Request, job_id, index: int):
        from genserver.jobs.models import JobSegment, SegmentStatus

        job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
        segment = JobSegment.objects.filter(job=job, index=index, status=SegmentStatus.PUBLISHED).first()
        if segment is None or not segment.key:
            raise Http404("no such segment published")
        if self.poster:
            return _serve(segment.poster_key, "image/png")
        return _serve(segment.key, "video/mp4")


class ModelListView(APIView):
    @extend_schema(responses={200: ModelInfoSerializer(many=True), **error_responses()})
    def get(self, request: Request) -> Response:
        """The registry's models, each with the step-time factors the service learned for it so far."""
        reg = deployment.registry()
        learned = selectors.step_time_corrections()
        return Response(
            [reg.get(name).public() | {"step_time_correction": learned.get(name, {})} for name in reg.names()]
        )


class StaffOnlyWorkers(IsAdminUser):
    """Worker names and nodes name the service's machines: staff only (anonymous stays a 401)."""

    message = {
        "detail": "Only staff may list the workers (they name the service's machines); "
        "GET /api/v1/queues/ gives every user the per-class summary.",
        "reason": "staff_only",
    }


class WorkerListView(APIView):
    permission_classes = [StaffOnlyWorkers]

    @extend_schema(
        responses={
            200: OpenApiTypes.OBJECT,
            **error_responses(403, s403="staff only: the workers name the service's machines"),
        }
    )
    def get(self, request: Request) -> Response:
        """Staff only. Live workers (`gpu0@NODE`): their node, queues, cards and the models each one holds;
        per node its workers and denoising cards; the embedding cache; merged denoise batches."""
        from genserver.metrics import embedding_cache_counts, merged_counts

        workers = selectors.live_workers()
        return Response(
            {
                "workers": workers,
                "nodes": selectors.nodes_overview(workers),
                "embedding_cache": embedding_cache_counts(),
                "merged_denoise": merged_counts(),
            }
        )


class QueueListView(APIView):
    @extend_schema(responses={200: QueueInfoSerializer(many=True), **error_responses()})
    def get(self, request: Request) -> Response:
        """Per duration class: depth, backlog, expected wait, whether it accepts work. Staff also see the
        workers and cards per node serving each class."""
        return Response(selectors.queue_overview(staff=request.user.is_staff))


class UsageView(APIView):
    @extend_schema(responses={200: UsageSerializer, **error_responses()})
    def get(self, request: Request) -> Response:
        """Your own counts against your quota and what remains: jobs in flight, submits in the rate window,
        card-seconds today (UTC), the models and lanes you may use, and when each limit resets."""
        return Response(UsageSerializer(selectors.usage_report(request.user)).data)
