"""Top-level routes: the API, its schema and docs, the admin, the health probes, the web page."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from genserver import health, metrics
from genserver.jobs.api import openai_images

urlpatterns = [
    path("api/v1/", include("genserver.jobs.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="redoc"),
    path("admin/", admin.site.urls),
    # --- The OpenAI Images API shape over ordinary jobs (no trailing slash, as OpenAI's clients call it).
    path("v1/images/generations", openai_images.ImageGenerationView.as_view(), name="openai-images-generate"),
    path("v1/models", openai_images.OpenAIModelListView.as_view(), name="openai-model-list"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    # --- The web page (genserver/web): `/`, sign in, sign out ---
    path("", include("genserver.web.urls")),
]

# Prometheus (docs/METRICS.md): a staff session or the bearer token GENSERVER_METRICS_TOKEN.
urlpatterns += [
    path("metrics", metrics.metrics_view, name="metrics"),
]

handler404 = "genserver.jobs.api.errors.not_found"  # JSON, never an HTML page, for clients of the API
