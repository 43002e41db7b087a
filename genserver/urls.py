"""Top-level routes: the API, its schema and docs, the admin, the health probes, the web page."""
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from genserver import health, metrics

urlpatterns = [
    path("api/v1/", include("genserver.jobs.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="redoc"),
    path("admin/", admin.site.urls),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    # --- The web page (genserver/web): `/`, sign in, sign out ---
    path("", include("genserver.web.urls")),
]

# Prometheus (docs/METRICS.md): a staff session or the bearer token GENSERVER_METRICS_TOKEN.
urlpatterns += [
    path("metrics", metrics.metrics_view, name="metrics"),
]
