"""genserver: a scheduling backend for image and video diffusion generation."""

from .celery import app as celery_app

__all__ = ("celery_app",)
