"""Top-level routes: the API, its schema and docs, the admin, the health probes."""
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from genserver import health
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
]

handler404 = "genserver.jobs.api.errors.not_found"  # JSON, never an HTML page, for clients of the API
