"""Request validation against the model registry, and the job's public representation."""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable
from datetime import datetime
from operator import attrgetter
from typing import Any

from django.utils.functional import cached_property
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.reverse import reverse
from rest_framework.utils.serializer_helpers import BindingDict

from genserver import deployment
from genserver.jobs.api.fields import (
    StrictCharField,
    StrictChoiceField,
    StrictFloatField,
    StrictIntegerField,
    StrictRegexField,
    StrictURLField,
)
from genserver.jobs.api.schema import NumOutputsField, PromptField, RegistryModelField
from genserver.jobs.models import WEBHOOK_EVENTS, Job
from genserver.registry import RegistryError

START_WITHIN_MAX_SECONDS = 7 * 24 * 3600  # a start deadline a week away is no deadline: leave start_within out


class JobCreateSerializer(serializers.Serializer):
    model = RegistryModelField(max_length=100, help_text="a model of GET /api/v1/models/")
    prompt = PromptField(max_length=20000, trim_whitespace=True)
    negative_prompt = StrictCharField(max_length=20000, required=False, allow_blank=True, default="")
    width = StrictIntegerField(required=False, min_value=1, max_value=16384)
    height = StrictIntegerField(required=False, min_value=1, max_value=16384)
    num_frames = StrictIntegerField(required=False, min_value=1, max_value=10000)
    steps = StrictIntegerField(required=False, min_value=1, max_value=10000)
    guidance_scale = StrictFloatField(required=False, min_value=0.0, max_value=1000.0)
    seed = StrictIntegerField(required=False, min_value=0, max_value=2**63 - 1)
    num_outputs = NumOutputsField()
    preview_every = StrictIntegerField(required=False, default=0, min_value=0, max_value=10000)
    webhook_url = StrictURLField(
        max_length=500,
        required=False,
        allow_blank=True,
        default="",
        help_text="http(s) URL that receives signed JSON events of the job",
    )
    webhook_events = serializers.ListField(
        child=StrictChoiceField(choices=WEBHOOK_EVENTS),
        required=False,
        max_length=len(WEBHOOK_EVENTS),
        help_text="which events webhook_url receives (default: started, succeeded, failed, cancelled); "
        "previews are sent at most once per GENSERVER_WEBHOOK_PREVIEW_SECONDS",
    )
    lane = StrictRegexField(
        r"^[a-z0-9][a-z0-9_-]{0,31}$",
        max_length=32,
        required=False,
        allow_blank=True,
        default="",
        help_text="route the job to the workers on this lane of the pool layout "
        '("interactive": a card group, for a user waiting on a video); '
        "where no worker serves it, the job runs as without a lane",
    )
    start_within = StrictIntegerField(
        required=False,
        min_value=1,
        max_value=START_WITHIN_MAX_SECONDS,
        help_text="seconds: accept the job only if it is expected to start (its first denoising step) within "
        "them (else 429 with the quote: expected_start_at, expected_finish_at); accepted, it ends "
        "`expired` if it has not started by then",
    )

    _shared_fields: BindingDict | None = None

    @cached_property
    def fields(self) -> BindingDict:  # type: ignore[override]
        """The declared fields, built and bound once per process and shared by every instance and thread. DRF
        deep-copies (re-constructs) every declared field for each instance and binds each copy to it: a tenth of
        a submit's CPU, then, with shallow copies, still 3 %. Validation only reads a field, and none of these
        reads its parent or the context but for the root's `partial`, which neither the shared fields' parent
        nor any request's serializer sets (tests/jobs/test_serializers.py: the same answers as DRF's copies,
        from threads validating at once)."""
        cls = type(self)
        shared = cls.__dict__.get("_shared_fields")
        if shared is None:
            shared = BindingDict(cls())  # their parent: a serializer of no request
            for name, field in copy.deepcopy(cls._declared_fields).items():
                shared[name] = field
            cls._shared_fields = shared
        return shared

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["Send a JSON object of job fields."]})
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {k: ["Unknown field; see GET /api/v1/models/ and the schema."] for k in unknown}
            )
        return super().to_internal_value(data)

    def validate_model(self, value: str) -> str:
        try:
            deployment.registry().get(value)
        except RegistryError:
            raise serializers.ValidationError(
                f"Unknown model {value!r}; available: {', '.join(deployment.registry().names())}."
            ) from None
        return value

    def validate_webhook_url(self, value: str) -> str:
        from genserver.webhooks import WebhookURLError, check_url

        if not value:
            return ""
        try:
            check_url(value)
        except WebhookURLError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value

    def validate_webhook_events(self, value: list[str]) -> list[str]:
        return [event for event in WEBHOOK_EVENTS if event in value]  # once each, in the order they happen

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "webhook_events" in attrs and not attrs.get("webhook_url"):
            raise serializers.ValidationError({"webhook_events": ["Set webhook_url too: the events are sent there."]})
        spec = deployment.registry().get(attrs["model"])
        lim, dflt = spec.limits, spec.defaults
        attrs.setdefault("width", dflt.width)
        attrs.setdefault("height", dflt.height)
        attrs.setdefault("num_frames", dflt.num_frames)
        attrs.setdefault("steps", dflt.steps)
        attrs.setdefault("guidance_scale", dflt.guidance_scale)
        if "seed" not in attrs:
            attrs["seed"] = secrets.randbelow(2**32)
            attrs["seed_drawn"] = True  # an idempotent retry without a seed matches the first one's
        errors: dict[str, list[str]] = {}
        for field, maximum in (("width", lim.max_width), ("height", lim.max_height)):
            value = attrs[field]
            if not lim.min_size <= value <= maximum:
                errors[field] = [f"Must be between {lim.min_size} and {maximum} for {spec.name}."]
            elif value % lim.size_multiple:
                errors[field] = [f"Must be a multiple of {lim.size_multiple} for {spec.name}."]
        if attrs["num_outputs"] > spec.max_batch:
            most = f"{spec.max_batch} output" + ("s" if spec.max_batch > 1 else "")
            errors["num_outputs"] = [f"At most {most} for {spec.name} (its max_batch); ask for fewer."]
        if spec.kind == "image" and attrs["num_frames"] != 1:
            errors["num_frames"] = [f"{spec.name} makes images; leave num_frames out or set it to 1."]
        elif spec.kind == "video":
            frames = attrs["num_frames"]
            if frames > lim.max_frames:
                errors["num_frames"] = [f"At most {lim.max_frames} frames for {spec.name}."]
            elif (frames - 1) % lim.frames_step:
                errors["num_frames"] = [f"Must be 1 + a multiple of {lim.frames_step} for {spec.name} (e.g. 81)."]
            elif attrs["num_outputs"] > 1 and frames > spec.segment_frames > 0 and "num_outputs" not in errors:
                errors["num_outputs"] = [
                    f"A video longer than {spec.segment_frames} frames runs in segments "
                    f"and makes one output; set num_outputs to 1."
                ]
        if attrs["steps"] > lim.max_steps:
            errors["steps"] = [f"At most {lim.max_steps} steps for {spec.name}."]
        if attrs["guidance_scale"] > lim.max_guidance:
            errors["guidance_scale"] = [f"At most {lim.max_guidance} for {spec.name}."]
        for field in ("prompt", "negative_prompt"):
            if len(attrs.get(field, "")) > lim.max_prompt_chars:
                errors[field] = [f"At most {lim.max_prompt_chars} characters for {spec.name}."]
        if attrs["preview_every"] > attrs["steps"]:
            errors["preview_every"] = ["Must not exceed steps (0 turns previews off)."]
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class StepsChangeSerializer(serializers.Serializer):
    """POST /jobs/{id}/steps/: a new total. Needs the job's `model` in the context (its max_steps)."""

    steps = StrictIntegerField(
        min_value=1,
        max_value=10000,
        help_text="the new total: at most the steps done stops the job at its next step "
        "and decodes its current x0 estimate; more continues refining",
    )

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ['Send a JSON object: {"steps": N}.']})
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({k: ["Unknown field; only `steps` can change."] for k in unknown})
        return super().to_internal_value(data)

    def validate_steps(self, value: int) -> int:
        spec = deployment.registry().get(self.context["model"])
        if value > spec.limits.max_steps:
            raise serializers.ValidationError(f"At most {spec.limits.max_steps} steps for {spec.name}.")
        return value


class PriorityChangeSerializer(serializers.Serializer):
    """POST /jobs/{id}/priority/ (staff): the Redis priority of the job's next message, within its class."""

    priority = StrictIntegerField(
        min_value=0,
        max_value=8,
        help_text="0 is served first; within the job's class band: short 0-3, medium 4-5, long 6-8",
    )

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ['Send a JSON object: {"priority": N}.']})
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({k: ["Unknown field; only `priority` can change."] for k in unknown})
        return super().to_internal_value(data)


_DATETIME = serializers.DateTimeField()  # renders only: one per process


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else _DATETIME.to_representation(moment)


class ProgressSerializer(serializers.Serializer):
    step = serializers.IntegerField()
    total_steps = serializers.IntegerField()


class OutputSerializer(serializers.Serializer):
    url = serializers.URLField()
    content_type = serializers.CharField()


class SegmentSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    frames = serializers.IntegerField(help_text="frames this segment adds to the video")
    seed = serializers.IntegerField()
    content_type = serializers.CharField()
    url = serializers.URLField()
    poster_url = serializers.URLField()


def _renderer(name: str, field: serializers.Field) -> Callable[[JobSerializer, Job], Any]:
    """How one of JobSerializer's fields renders a job: its `get_<name>` method, or the attribute its source
    names through the field's to_representation (None stays None, as DRF leaves it)."""
    if isinstance(field, serializers.SerializerMethodField):
        method = f"get_{name}"
        return lambda serializer, job: getattr(serializer, method)(job)
    read = attrgetter(field.source or name)

    def render(serializer: JobSerializer, job: Job) -> Any:
        value = read(job)
        return None if value is None else field.to_representation(value)

    return render


class JobSerializer(serializers.ModelSerializer):
    """A job as its owner sees it. Needs `snapshot` (a QueueSnapshot) and `request` in the context."""

    progress = serializers.SerializerMethodField()
    queue_position = serializers.SerializerMethodField()
    eta_seconds = serializers.SerializerMethodField()
    expected_start_at = serializers.SerializerMethodField()
    expected_finish_at = serializers.SerializerMethodField()
    estimated_seconds = serializers.SerializerMethodField()
    preview_url = serializers.SerializerMethodField()
    outputs = serializers.SerializerMethodField()
    steps_requested = serializers.SerializerMethodField()
    segments = serializers.SerializerMethodField()
    owner = serializers.CharField(source="owner.username", read_only=True)
    webhook_url = serializers.CharField(read_only=True, help_text="the job's webhook receiver; empty when none")

    class Meta:
        model = Job
        fields = [
            "id",
            "owner",
            "model",
            "kind",
            "status",
            "stage",
            "held",
            "progress",
            "queue_position",
            "eta_seconds",
            "expected_start_at",
            "expected_finish_at",
            "start_deadline",
            "estimated_seconds",
            "duration_class",
            "queue",
            "preview_url",
            "preview_step",
            "outputs",
            "segment_count",
            "segments",
            "error",
            "prompt",
            "negative_prompt",
            "width",
            "height",
            "num_frames",
            "steps",
            "steps_requested",
            "guidance_scale",
            "seed",
            "num_outputs",
            "preview_every",
            "webhook_url",
            "webhook_events",
            "attempts",
            "cancel_requested",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields

    _built_fields: dict[str, serializers.Field] | None = None
    _rendering: list[tuple[str, Callable[[JobSerializer, Job], Any]]] | None = None

    def get_fields(self) -> dict[str, serializers.Field]:
        """ModelSerializer's fields, built from the model once per process and copied for each instance:
        building them reads the model's options field by field, about 2 ms of every job answered alone.
        The answer itself does not use them (to_representation); the schema and the browsable API do."""
        return copy.deepcopy(self._fields_once())

    @classmethod
    def _fields_once(cls) -> dict[str, serializers.Field]:
        if cls.__dict__.get("_built_fields") is None:
            cls._built_fields = super().get_fields(cls())
        return cls._built_fields

    def to_representation(self, job: Job) -> dict[str, Any]:
        """What DRF's Serializer.to_representation answers, without binding a copy of every field to each
        job answered (a fifth of a submit's time): each field renders through its one per-process instance,
        which only reads itself (tests/jobs/test_api.py compares the two over jobs in every state)."""
        return {name: render(self, job) for name, render in self._rendering_once()}

    @classmethod
    def _rendering_once(cls) -> list[tuple[str, Callable[[JobSerializer, Job], Any]]]:
        if cls.__dict__.get("_rendering") is None:
            cls._rendering = [(name, _renderer(name, field)) for name, field in cls._fields_once().items()]
        return cls._rendering

    @extend_schema_field(OpenApiTypes.INT)
    def get_steps_requested(self, job: Job) -> int:
        """The total asked at submit (`steps` differs once it was changed midway)."""
        return job.steps_requested if job.steps_requested is not None else job.steps

    @extend_schema_field(ProgressSerializer)
    def get_progress(self, job: Job) -> dict[str, int]:
        return {"step": job.steps_done, "total_steps": job.total_steps}  # over all segments of a long video

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_queue_position(self, job: Job) -> int | None:
        return self.context["snapshot"].queue_position(job)

    _times_of: tuple[Job, tuple[float | None, datetime | None, datetime | None]] | None = None

    def _times(self, job: Job) -> tuple[float | None, datetime | None, datetime | None]:
        """The snapshot's (eta, expected start, expected finish) of the job, reckoned once for its three fields."""
        if self._times_of is None or self._times_of[0] is not job:
            self._times_of = (job, self.context["snapshot"].times(job))
        return self._times_of[1]

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_eta_seconds(self, job: Job) -> float | None:
        return self._times(job)[0]

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_expected_start_at(self, job: Job) -> str | None:
        """When its first denoising step is expected (when it was, once it started); from the ETA's numbers."""
        return _iso(self._times(job)[1])

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_expected_finish_at(self, job: Job) -> str | None:
        """When its denoising is expected to end: now + eta_seconds (null when eta_seconds is)."""
        return _iso(self._times(job)[2])

    @extend_schema_field(OpenApiTypes.FLOAT)
    def get_estimated_seconds(self, job: Job) -> float:
        return round(job.estimated_seconds * job.clock_scale, 3)

    @extend_schema_field(serializers.URLField(allow_null=True))
    def get_preview_url(self, job: Job) -> str | None:
        if not job.preview_key:
            return None
        return reverse("job-preview", args=[job.pk], request=self.context.get("request"))

    @extend_schema_field(OutputSerializer(many=True))
    def get_outputs(self, job: Job) -> list[dict[str, str]]:
        request = self.context.get("request")
        return [
            {"url": reverse("job-output", args=[job.pk, i], request=request), "content_type": out["content_type"]}
            for i, out in enumerate(job.outputs)
        ]

    @extend_schema_field(SegmentSerializer(many=True))
    def get_segments(self, job: Job) -> list[dict]:
        """A long video's segments published so far, in order (empty for a video of one segment)."""
        if job.segment_count <= 1:
            return []
        from genserver.jobs.models import SegmentStatus

        request = self.context.get("request")
        published = sorted(
            (s for s in job.segments.all() if s.status == SegmentStatus.PUBLISHED and s.key), key=lambda s: s.index
        )
        return [
            {
                "index": s.index,
                "frames": s.frames,
                "seed": s.seed,
                "content_type": "video/mp4",
                "url": reverse("job-segment", args=[job.pk, s.index], request=request),
                "poster_url": reverse("job-segment-poster", args=[job.pk, s.index], request=request),
            }
            for s in published
        ]
