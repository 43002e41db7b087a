"""Django admin for jobs (filters, search, actions through the job service), quotas, and everyone's usage."""

from datetime import timedelta

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db.models import Case, Count, F, Q, Sum, When
from django.template.response import TemplateResponse
from django.utils import timezone

from genserver.jobs import selectors, services
from genserver.jobs.models import ACTIVE, TERMINAL, ApiToken, Job, JobSegment, Quota, UserUsage
from genserver.jobs.services import tokens


class JobSegmentInline(admin.TabularInline):
    """A long video's segments (read-only, like the job)."""

    model = JobSegment
    extra = 0
    can_delete = False
    fields = ("index", "frames", "seed", "status", "attempts", "key", "decoded_at", "error")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "owner",
        "model",
        "status",
        "stage",
        "duration_class",
        "priority",
        "steps_done",
        "steps",
        "attempts",
        "created_at",
        "finished_at",
    )
    list_filter = ("status", "duration_class", "model", "kind", "backend", "held")
    search_fields = ("id", "prompt", "owner__username", "error")
    date_hierarchy = "created_at"
    actions = ("cancel_jobs", "retry_from_checkpoint", "move_to_front")
    # The job service alone changes state: everything is read-only here, actions do the writing.
    readonly_fields = [f.name for f in Job._meta.fields]
    inlines = [JobSegmentInline]

    def has_add_permission(self, request) -> bool:
        return False

    @admin.action(description="Cancel selected jobs")
    def cancel_jobs(self, request, queryset):
        ended = sum(1 for job in queryset if services.cancel_job(job).status == "cancelled")
        self.message_user(request, f"Cancel requested for {queryset.count()} job(s); {ended} ended at once.")

    @admin.action(description="Retry failed jobs from their last checkpoint")
    def retry_from_checkpoint(self, request, queryset):
        retried = sum(1 for job in queryset if services.retry_failed(job))
        self.message_user(
            request, f"Re-queued {retried} failed job(s).", messages.SUCCESS if retried else messages.WARNING
        )

    @admin.action(description="Re-prioritise: move to the front of their class")
    def move_to_front(self, request, queryset):
        """Each job's class band's first priority (as POST /jobs/{id}/priority/ would); an ended one is skipped."""
        moved = skipped = 0
        for job in queryset:
            try:
                services.reprioritise(job, services.priority_bounds(job)[0])
                moved += 1
            except services.PriorityRefused:
                skipped += 1
        note = f"; {skipped} had ended and stay as they are" if skipped else ""
        self.message_user(
            request, f"Re-prioritised {moved} job(s){note}.", messages.SUCCESS if moved else messages.WARNING
        )


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    """Per-user or per-group limits (blank: the settings' default; 0: no limit; empty lists: all)."""

    list_display = (
        "__str__",
        "max_jobs_in_flight",
        "submits_per_minute",
        "card_seconds_per_day",
        "allowed_models",
        "allowed_lanes",
        "updated_at",
    )
    list_select_related = ("user", "group")
    search_fields = ("user__username", "group__name")
    autocomplete_fields = ("user", "group")
    fields = (
        "user",
        "group",
        "max_jobs_in_flight",
        "submits_per_minute",
        "card_seconds_per_day",
        "allowed_models",
        "allowed_lanes",
    )


@admin.register(UserUsage)
class UserUsageAdmin(admin.ModelAdmin):
    """Every user's counts against their quota (read-only), as GET /api/v1/usage/ shows each their own."""

    list_display = (
        "username",
        "quota_source",
        "in_flight_jobs",
        "submits_in_window",
        "card_seconds_used_today",
        "card_seconds_limit",
    )
    search_fields = ("username",)
    ordering = ("username",)
    fields = ("username", "quota_source", "in_flight_jobs", "submits_in_window", "card_seconds_used_today")
    readonly_fields = fields

    def get_queryset(self, request):
        now = timezone.now()
        day_start = selectors.next_utc_midnight(now) - timedelta(days=1)
        window_start = now - timedelta(seconds=settings.SUBMIT_RATE_WINDOW)
        return (
            super()
            .get_queryset(request)
            .annotate(
                in_flight=Count("jobs", filter=Q(jobs__status__in=ACTIVE, jobs__cancel_requested=False)),
                submits=Count("jobs", filter=Q(jobs__created_at__gte=window_start)),
                card_today=Sum(
                    Case(
                        When(jobs__status__in=TERMINAL, then=F("jobs__card_seconds")),
                        default=F("jobs__charged_card_seconds"),
                    ),
                    filter=Q(jobs__created_at__gte=day_start),
                ),
            )
        )

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def has_view_permission(self, request, obj=None) -> bool:
        return request.user.is_active and request.user.is_staff

    def has_module_permission(self, request) -> bool:
        return request.user.is_active and request.user.is_staff

    @admin.display(description="quota")
    def quota_source(self, user) -> str:
        return selectors.effective_quota(user).source

    @admin.display(description="jobs in flight", ordering="in_flight")
    def in_flight_jobs(self, user) -> str:
        limit = selectors.effective_quota(user).max_jobs_in_flight
        return f"{user.in_flight} / {limit or '∞'}"

    @admin.display(description="submits this minute", ordering="submits")
    def submits_in_window(self, user) -> str:
        limit = selectors.effective_quota(user).submits_per_minute
        return f"{user.submits} / {limit or '∞'}"

    @admin.display(description="card-seconds today (UTC)", ordering="card_today")
    def card_seconds_used_today(self, user) -> str:
        return f"{user.card_today or 0.0:.1f}"

    @admin.display(description="card-seconds per day")
    def card_seconds_limit(self, user) -> str:
        return f"{selectors.effective_quota(user).card_seconds_per_day or '∞'}"


class ApiTokenCreateForm(forms.ModelForm):
    """The admin's "add API token": whose, what for, how long. The key is made by the token service."""

    expires_in_days = forms.IntegerField(
        min_value=0,
        max_value=3650,
        initial=settings.API_TOKEN_DAYS,
        help_text="0: never expires",
    )

    class Meta:
        model = ApiToken
        fields = ("user", "name")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens of every user: prefix, name, dates, state; add one (its key shown once), revoke."""

    list_display = ("prefix", "user", "name", "created_at", "expires_at", "last_used_at", "revoked_at", "state")
    list_filter = ("revoked_at", "expires_at")
    search_fields = ("prefix", "name", "user__username")
    list_select_related = ("user",)
    actions = ("revoke_tokens",)
    readonly_fields = ("user", "name", "prefix", "created_at", "expires_at", "last_used_at", "revoked_at")
    exclude = ("digest",)  # a hash, useless to a reader, never shown

    @admin.display(description="state")
    def state(self, token: ApiToken) -> str:
        return token.state()

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = ApiTokenCreateForm
        return super().get_form(request, obj, change, **kwargs)

    def get_readonly_fields(self, request, obj=None):
        return self.readonly_fields if obj is not None else ()

    def get_fields(self, request, obj=None):
        return ("user", "name", "expires_in_days") if obj is None else self.readonly_fields

    def has_change_permission(self, request, obj=None) -> bool:
        return obj is None and super().has_change_permission(request, obj)  # a token is never edited: revoke it

    def save_model(self, request, obj, form, change) -> None:
        """Through the token service; the raw key is kept on the request for response_add only."""
        days = form.cleaned_data["expires_in_days"]
        expires_at = timezone.now() + timedelta(days=days) if days else None
        token, key = tokens.issue(obj.user, obj.name, expires_at, never_expires=days == 0)
        obj.pk = token.pk
        obj.__dict__.update({f.attname: getattr(token, f.attname) for f in ApiToken._meta.concrete_fields})
        request._new_api_key = key  # type: ignore[attr-defined]

    def response_add(self, request, obj, post_url_continue=None):
        """A page showing the key this once (not a message: messages travel in a cookie or the session)."""
        return TemplateResponse(
            request,
            "admin/jobs/apitoken/key_once.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "token": obj,
                "key": request._new_api_key,
                "title": "API token created",
            },
        )

    @admin.action(description="Revoke selected tokens (refused from now on)")
    def revoke_tokens(self, request, queryset):
        revoked = sum(1 for token in queryset if tokens.revoke(token))
        self.message_user(request, f"Revoked {revoked} token(s).", messages.SUCCESS if revoked else messages.WARNING)
