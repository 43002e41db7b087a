"""Routes of /api/v1/."""

from django.urls import path

from genserver.jobs.api import events, tokens, views

urlpatterns = [
    path("jobs/", views.JobListCreateView.as_view(), name="job-list"),
    path("jobs/<uuid:job_id>/", views.JobDetailView.as_view(), name="job-detail"),
    # --- events (issue 13): the job's server-sent events, an async view served under ASGI
    path("jobs/<uuid:job_id>/events/", events.job_events, name="job-events"),
    path("jobs/<uuid:job_id>/cancel/", views.JobCancelView.as_view(), name="job-cancel"),
    path("jobs/<uuid:job_id>/steps/", views.JobStepsView.as_view(), name="job-steps"),
    path("jobs/<uuid:job_id>/priority/", views.JobPriorityView.as_view(), name="job-priority"),
    path("jobs/<uuid:job_id>/outputs/<int:index>/", views.JobOutputView.as_view(), name="job-output"),
    path("jobs/<uuid:job_id>/preview/", views.JobPreviewView.as_view(), name="job-preview"),
    path("jobs/<uuid:job_id>/segments/<int:index>/", views.JobSegmentView.as_view(), name="job-segment"),
    path(
        "jobs/<uuid:job_id>/segments/<int:index>/poster/",
        views.JobSegmentView.as_view(poster=True),
        name="job-segment-poster",
    ),
    path("models/", views.ModelListView.as_view(), name="model-list"),
    path("queues/", views.QueueListView.as_view(), name="queue-list"),
    path("workers/", views.WorkerListView.as_view(), name="worker-list"),
    path("usage/", views.UsageView.as_view(), name="usage"),
    # --- API tokens: the signed-in user's own (genserver/jobs/api/tokens.py)
    path("tokens/", tokens.TokenListCreateView.as_view(), name="token-list"),
    path("tokens/<int:token_id>/", tokens.TokenDetailView.as_view(), name="token-detail"),
]
