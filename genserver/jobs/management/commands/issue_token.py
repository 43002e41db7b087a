"""`manage.py issue_token USER [--name N] [--expires-in DAYS]`: create the user if needed and print a new API token.

The key is printed once (the database keeps only its hash). `--list` shows the user's tokens instead,
`--revoke PREFIX` revokes one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from genserver.jobs import selectors
from genserver.jobs.services import tokens


class Command(BaseCommand):
    help = (
        "Create USER if needed and print a new API token (Authorization: Token <key>, or Bearer <key>); "
        "the key is shown only now. --list shows USER's tokens, --revoke PREFIX revokes one."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("username")
        parser.add_argument("--staff", action="store_true", help="make the user staff (sees all jobs, admin)")
        parser.add_argument("--name", default="", help="what the token is for (shown in lists)")
        parser.add_argument(
            "--expires-in",
            type=int,
            default=None,
            metavar="DAYS",
            help=f"days it lives (default GENSERVER_API_TOKEN_DAYS, now {settings.API_TOKEN_DAYS}); 0: never expires",
        )
        parser.add_argument(
            "--replace", action="store_true", help="revoke USER's other live tokens of the same --name first"
        )
        parser.add_argument("--list", action="store_true", help="list USER's tokens (not revoked) instead")
        parser.add_argument("--revoke", metavar="PREFIX", help="revoke USER's token whose key starts so, instead")

    def handle(self, *args: Any, **options: Any) -> None:
        username, name, days = options["username"], options["name"], options["expires_in"]
        if days is not None and days < 0:
            raise CommandError("--expires-in takes a number of days ≥ 1, or 0 for a token that never expires.")
        if len(name) > 100:
            raise CommandError("--name takes at most 100 characters.")
        if options["list"] or options["revoke"]:
            user = get_user_model().objects.filter(username=username).first()
            if user is None:
                raise CommandError(f"No user {username!r}.")
            if options["revoke"]:
                self._revoke(user, options["revoke"])
            else:
                self._list(user)
            return
        user, created = get_user_model().objects.get_or_create(username=username)
        if created:
            user.set_unusable_password()
        if options["staff"]:
            user.is_staff = user.is_superuser = True
        user.save()
        if options["replace"]:
            tokens.revoke_named(user, name)
        expires_at = None if not days else timezone.now() + timedelta(days=days)
        token, key = tokens.issue(user, name, expires_at, never_expires=days == 0)
        when = "never expires" if token.expires_at is None else f"expires {token.expires_at:%Y-%m-%d %H:%M} UTC"
        self.stderr.write(f"token {token.prefix}… of {username} ({when}); the key, shown only now:")
        self.stdout.write(key)

    def _list(self, user: Any) -> None:
        for token in selectors.api_tokens_of(user):
            expires = "never" if token.expires_at is None else f"{token.expires_at:%Y-%m-%d %H:%M}"
            used = "never" if token.last_used_at is None else f"{token.last_used_at:%Y-%m-%d %H:%M}"
            self.stdout.write(
                f"{token.prefix}…  {token.state():8}  created {token.created_at:%Y-%m-%d %H:%M}  "
                f"expires {expires}  last used {used}  {token.name}"
            )

    def _revoke(self, user: Any, prefix: str) -> None:
        prefix = prefix.rstrip("…").strip()
        found = [t for t in selectors.api_tokens_of(user) if t.prefix.startswith(prefix)] if prefix else []
        if len(found) != 1:
            raise CommandError(
                f"{len(found)} live tokens of {user.username} start with {prefix!r}: give a prefix from --list "
                "that names exactly one."
            )
        tokens.revoke(found[0])
        self.stdout.write(f"revoked {found[0].prefix}…")
