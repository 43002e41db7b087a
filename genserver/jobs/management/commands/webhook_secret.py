"""`manage.py webhook_secret`: print the key webhook receivers verify X-Genserver-Signature with."""

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Print the webhook signing secret (GENSERVER_WEBHOOK_SECRET, or the one derived from "
        "DJANGO_SECRET_KEY when it is unset): give it to your webhook receivers."
    )
    requires_system_checks: list = []  # reads one setting; nothing else needs to be in place

    def handle(self, **options):
        if not settings.WEBHOOK_SECRET_IS_SET:
            self.stderr.write(
                "GENSERVER_WEBHOOK_SECRET is unset: this secret is derived from DJANGO_SECRET_KEY "
                "and changes with it; set GENSERVER_WEBHOOK_SECRET to keep receivers verifying."
            )
        self.stdout.write(settings.WEBHOOK_SECRET)
