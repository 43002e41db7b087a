"""Error responses: DRF's field errors for 400s, and 503 (never a traceback) when a backing service is down."""
from __future__ import annotations

import logging

from django.db import DatabaseError
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
        return Response({"detail": f"The {service} is unavailable; retry shortly.", "reason": "unavailable"},
                        status=status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": "5"})
    return None
