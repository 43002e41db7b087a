"""Error responses: DRF's field errors for 400s, and 503 (never a traceback) when a backing service is down."""

from __future__ import annotations

import logging

from django.db import DatabaseError
from django.http import JsonResponse
from django.views.defaults import page_not_found
from redis.exceptions import RedisError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

log = logging.getLogger(__name__)


def exception_handler(exc, context):
    response = drf_exception_handler(exc, context)
    if response is not None:
        return response
    if isinstance(exc, (DatabaseError, RedisError, ConnectionError)):
        service = "database" if isinstance(exc, DatabaseError) else "broker (Redis)"
        log.error("%s unavailable while serving %s: %s", service, context.get("request"), exc)
        return Response(
            {"detail": f"The {service} is unavailable; retry shortly.", "reason": "unavailable"},
            status=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "5"},
        )
    return None


def not_found(request, exception=None):
    """Django's 404 for a URL no route matches (e.g. a job id that is not a UUID): JSON in the API's shapes.

    Under /v1/ (the OpenAI endpoints) in OpenAI's error shape, under /api/ in the
    API's `{"detail", "reason"}`; an HTML page would break generated clients.
    """
    if not request.path.startswith(("/api/", "/v1/")):
        return page_not_found(request, exception)  # the web page and the admin keep Django's HTML page
    message = f"No such resource: {request.path} (see /api/schema/ for the routes)."
    if request.path.startswith("/v1/"):
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "not_found"}}
    else:
        body = {"detail": message, "reason": "not_found"}
    return JsonResponse(body, status=status.HTTP_404_NOT_FOUND)
