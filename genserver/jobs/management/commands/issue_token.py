"""`manage.py issue_token USER`: create the user if needed and print an API token."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Create USER if needed and print their API token (Authorization: Token <token>)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--staff", action="store_true", help="make the user staff (sees all jobs, admin)")

    def handle(self, username: str, staff: bool, **options):
        user, created = get_user_model().objects.get_or_create(username=username)
        if created:
            user.set_unusable_password()
        if staff:
            user.is_staff = user.is_superuser = True
        user.save()
        token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(token.key)
