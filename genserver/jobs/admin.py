"""Django admin for jobs: filters, search, and actions that go through the job service."""

from django.contrib import admin, messages

from genserver.jobs import services
from genserver.jobs.models import Job, JobSegment


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
    list_filter = ("status", "duration_class", "model", "kind", "backend")
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
