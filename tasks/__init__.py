"""Celery tasks, thin: each takes ids, re-fetches the job, calls the job service and the runtime."""

from workers import heartbeat  # noqa: F401 - worker liveness for GET /queues/

from . import decode, denoise, encode, maintenance, probe, segments, webhooks  # noqa: F401 - registers the tasks
