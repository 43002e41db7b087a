"""`manage.py make_tiny_models`: write tiny random-weight checkpoints of every family into the data directory."""

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Generate tiny random-weight diffusers checkpoints (tests and the CPU demo); idempotent."
    requires_system_checks: list = []  # it is what makes the checkpoint check pass

    def handle(self, **options):
        from workers.runtime.tiny_models import ensure_tiny_models

        for path in ensure_tiny_models(settings.MODELS_DIR):
            self.stdout.write(str(path))
