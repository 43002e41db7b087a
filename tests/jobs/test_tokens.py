"""API tokens: hashed, expiring, several per user; made and revoked by the API, the command and the admin."""

from __future__ import annotations

import io
import uuid
from datetime import datetime, timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from genserver.jobs.models import ApiToken
from genserver.jobs.services import tokens

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"


def as_token(key: str, keyword: str = "Token") -> APIClient:
    return APIClient(HTTP_AUTHORIZATION=f"{keyword} {key}")


def user(name: str = "alice", **fields):
    return get_user_model().objects.create_user(username=name, **fields)


def test_several_tokens_per_user_each_work_under_token_and_bearer():
    alice = user()
    (laptop, laptop_key), (ci, ci_key) = tokens.issue(alice, "laptop"), tokens.issue(alice, "ci")
    assert laptop.pk != ci.pk and laptop_key != ci_key
    for key in (laptop_key, ci_key):
        for keyword in ("Token", "Bearer"):
            assert as_token(key, keyword).get(JOBS).status_code == 200, (key, keyword)
    assert set(ApiToken.objects.filter(user=alice).values_list("name", flat=True)) == {"laptop", "ci"}


def test_a_revoked_token_is_a_401_at_once_and_the_others_still_work():
    alice = user()
    _, kept = tokens.issue(alice, "kept")
    doomed, key = tokens.issue(alice, "doomed")
    client = as_token(key)
    assert client.get(JOBS).status_code == 200
    assert tokens.revoke(doomed) and not tokens.revoke(doomed)  # revoking twice changes nothing
    refused = client.get(JOBS)
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    assert refused.has_header("WWW-Authenticate")
    assert as_token(key, "Bearer").post(JOBS, {}, format="json").status_code == 401  # before anything is read
    assert as_token(kept).get(JOBS).status_code == 200


def test_an_expired_token_is_a_401_at_once_naming_what_to_do(monkeypatch):
    token, key = tokens.issue(user(), "soon", timezone.now() + timedelta(hours=1))
    assert as_token(key).get(JOBS).status_code == 200  # the process now holds a copy of the row
    # The clock passes the expiry: the copy's expires_at is checked on every request, as the row's was.
    later = token.expires_at + timedelta(seconds=1)
    monkeypatch.setattr(timezone, "now", lambda: later)
    refused = as_token(key).get(JOBS)
    assert refused.status_code == 401
    assert "expired" in refused.json()["detail"] and "POST /api/v1/tokens/" in refused.json()["detail"]


def test_the_database_holds_no_usable_key():
    """The row keeps a prefix and a SHA-256; neither, nor anything else stored, authenticates."""
    token, key = tokens.issue(user(), "laptop")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {ApiToken._meta.db_table}")
        stored = [str(value) for row in cursor.fetchall() for value in row]
    assert not any(key in value for value in stored)  # the key is nowhere in the table
    assert token.digest != key and len(token.digest) == 64 and key.startswith(token.prefix)
    for presented in {*stored, token.digest, token.prefix, key[:-1], key + "x"}:
        assert as_token(presented).get(JOBS).status_code == 401, presented
    assert as_token(key).get(JOBS).status_code == 200


def test_an_inactive_users_token_is_refused():
    alice = user()
    _, key = tokens.issue(alice)
    assert as_token(key).get(JOBS).status_code == 200  # the process now holds a copy of alice's row
    alice.is_active = False
    alice.save()  # as the admin does: the copy ends with the save
    assert as_token(key).get(JOBS).status_code == 401


def test_last_use_is_recorded_at_most_once_a_minute(monkeypatch):
    token, key = tokens.issue(user())
    assert token.last_used_at is None
    as_token(key).get(JOBS)
    first = ApiToken.objects.get(pk=token.pk).last_used_at
    assert first is not None
    as_token(key).get(JOBS)
    assert ApiToken.objects.get(pk=token.pk).last_used_at == first  # within the resolution: no write
    for later in (first + tokens.LAST_USED_RESOLUTION / 2, first + tokens.LAST_USED_RESOLUTION):
        monkeypatch.setattr(timezone, "now", lambda at=later: at)
        as_token(key).get(JOBS)
    assert ApiToken.objects.get(pk=token.pk).last_used_at == later  # a resolution on: written again
    monkeypatch.setattr(timezone, "now", lambda: later + tokens.LAST_USED_RESOLUTION / 2)
    as_token(key).get(JOBS)
    assert ApiToken.objects.get(pk=token.pk).last_used_at == later  # the process's copy knows of that write


# --- /api/v1/tokens/ -------------------------------------------------------------------------------------------


def test_post_makes_a_token_whose_key_is_shown_once_and_get_lists_without_keys(settings):
    alice = user()
    _, key = tokens.issue(alice, "first")
    client = as_token(key)
    made = client.post("/api/v1/tokens/", {"name": "ci", "expires_in_days": 7}, format="json")
    assert made.status_code == 201, made.json()
    body = made.json()
    assert body["name"] == "ci" and body["state"] == "active" and body["key"].startswith(body["prefix"])
    lifetime = datetime.fromisoformat(body["expires_at"]) - timezone.now()
    assert timedelta(days=6, hours=23) < lifetime <= timedelta(days=7)
    assert as_token(body["key"], "Bearer").get(JOBS).status_code == 200
    listed = client.get("/api/v1/tokens/").json()
    assert {t["name"] for t in listed} == {"first", "ci"}
    assert all("key" not in t and "digest" not in t for t in listed)
    assert body["key"] not in str(listed)
    # The default lifetime: GENSERVER_API_TOKEN_DAYS, from a session (the web page).
    session = Client()
    session.force_login(alice)
    default = session.post("/api/v1/tokens/", {}, content_type="application/json").json()
    lifetime = datetime.fromisoformat(default["expires_at"]) - timezone.now()
    assert timedelta(days=settings.API_TOKEN_DAYS - 1) < lifetime <= timedelta(days=settings.API_TOKEN_DAYS)


def test_delete_revokes_ones_own_token_only():
    alice, bob = user("alice"), user("bob")
    _, alice_key = tokens.issue(alice, "main")
    other, other_key = tokens.issue(alice, "other")
    bobs, bob_key = tokens.issue(bob)
    client = as_token(alice_key)
    assert client.delete(f"/api/v1/tokens/{bobs.pk}/").status_code == 404  # another user's: not found
    assert as_token(bob_key).get(JOBS).status_code == 200
    assert client.delete(f"/api/v1/tokens/{other.pk}/").status_code == 204
    assert as_token(other_key).get(JOBS).status_code == 401
    assert client.delete(f"/api/v1/tokens/{other.pk}/").status_code == 404  # revoked: gone from the list
    assert [t["name"] for t in client.get("/api/v1/tokens/").json()] == ["main"]
    # Revoking the token the request came with: that request ends, the next is a 401.
    main = ApiToken.objects.get(user=alice, name="main")
    assert client.delete(f"/api/v1/tokens/{main.pk}/").status_code == 204
    assert client.get("/api/v1/tokens/").status_code == 401


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": 12345}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"expires_in_days": 0}, "expires_in_days"),
        ({"expires_in_days": True}, "expires_in_days"),
        ({"expires_in_days": 10**6}, "expires_in_days"),
        ({"key": "mine"}, "key"),
        (["name"], "non_field_errors"),
    ],
)
def test_bad_token_requests_are_400_naming_the_field_and_make_nothing(body, field):
    alice = user()
    _, key = tokens.issue(alice)
    response = as_token(key).post("/api/v1/tokens/", body, format="json")
    assert response.status_code == 400 and field in response.json(), response.json()
    assert ApiToken.objects.filter(user=alice).count() == 1


def test_a_token_made_with_a_token_does_not_outlive_it():
    maker, key = tokens.issue(user(), "maker", timezone.now() + timedelta(days=10, hours=1))
    client = as_token(key)
    longer = client.post("/api/v1/tokens/", {"expires_in_days": 30}, format="json")
    assert longer.status_code == 400 and "10 day" in longer.json()["expires_in_days"][0]
    default = client.post("/api/v1/tokens/", {"name": "child"}, format="json").json()  # default cut to the maker's
    assert datetime.fromisoformat(default["expires_at"]) == maker.expires_at
    assert client.post("/api/v1/tokens/", {"expires_in_days": 10}, format="json").status_code == 201


def test_live_tokens_per_user_are_capped(monkeypatch):
    monkeypatch.setattr(tokens, "MAX_LIVE_TOKENS_PER_USER", 2)
    alice = user()
    _, key = tokens.issue(alice)
    revoked, _ = tokens.issue(alice)
    tokens.revoke(revoked)  # a revoked one does not count
    assert as_token(key).post("/api/v1/tokens/", {}, format="json").status_code == 201
    refused = as_token(key).post("/api/v1/tokens/", {}, format="json")
    assert refused.status_code == 400 and "revoke one" in refused.json()["non_field_errors"][0]
    assert tokens.selectors.live_api_tokens(alice).count() == 2


def test_the_event_stream_takes_both_header_forms_and_refuses_a_revoked_token():
    token, key = tokens.issue(user())
    missing_job = f"/api/v1/jobs/{uuid.uuid4()}/events/"
    for keyword in ("Token", "Bearer"):
        assert Client().get(missing_job, HTTP_AUTHORIZATION=f"{keyword} {key}").status_code == 404  # authenticated
    tokens.revoke(token)
    for keyword in ("Token", "Bearer"):
        refused = Client().get(missing_job, HTTP_AUTHORIZATION=f"{keyword} {key}")
        assert refused.status_code == 401 and "revoked" in refused.json()["detail"]


def test_the_openai_endpoint_says_a_token_expired():
    token, key = tokens.issue(user())
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    refused = Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key" and "expired" in refused.json()["error"]["message"]


# --- manage.py issue_token -------------------------------------------------------------------------------------


def issue_token(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("issue_token", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def test_issue_token_prints_a_working_key_once_with_name_and_expiry(settings):
    key, note = issue_token("carol", "--name", "laptop", "--expires-in", "3")
    token = ApiToken.objects.get(user__username="carol")
    assert token.name == "laptop" and key.startswith(token.prefix) and token.prefix in note
    assert timedelta(days=2, hours=23) < token.expires_at - timezone.now() <= timedelta(days=3)
    assert as_token(key).get(JOBS).status_code == 200
    listed, _ = issue_token("carol", "--list")
    assert token.prefix in listed and "laptop" in listed and key not in listed
    # A second one: several per user; without --expires-in the default lifetime; 0: never expires.
    issue_token("carol", "--name", "ci")
    default = ApiToken.objects.get(user__username="carol", name="ci")
    assert timedelta(days=settings.API_TOKEN_DAYS - 1) < default.expires_at - timezone.now()
    issue_token("carol", "--name", "robot", "--expires-in", "0")
    assert ApiToken.objects.get(user__username="carol", name="robot").expires_at is None
    assert ApiToken.objects.filter(user__username="carol", revoked_at__isnull=True).count() == 3


def test_issue_token_replace_and_revoke():
    first, _ = issue_token("demo", "--name", "make up", "--replace")
    second, _ = issue_token("demo", "--name", "make up", "--replace")  # as each `make up` does
    assert as_token(first).get(JOBS).status_code == 401 and as_token(second).get(JOBS).status_code == 200
    token = tokens.authenticate(second)
    out, _ = issue_token("demo", "--revoke", token.prefix)
    assert "revoked" in out and as_token(second).get(JOBS).status_code == 401
    with pytest.raises(CommandError, match="give a prefix"):
        issue_token("demo", "--revoke", "nothing-like-this")
    with pytest.raises(CommandError, match="No user"):
        issue_token("nobody", "--list")
    with pytest.raises(CommandError, match="--expires-in"):
        issue_token("demo", "--expires-in", "-1")


# --- the admin ---------------------------------------------------------------------------------------------------


@pytest.fixture
def admin_client():
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "pw"))
    return client


def test_admin_makes_a_token_showing_its_key_once_lists_and_revokes(admin_client):
    alice = user()
    assert admin_client.get("/admin/jobs/apitoken/add/").status_code == 200
    page = admin_client.post(
        "/admin/jobs/apitoken/add/", {"user": alice.pk, "name": "from admin", "expires_in_days": 5}
    )
    assert page.status_code == 200, page.content[:2000]
    key = page.context["key"]
    token = ApiToken.objects.get(user=alice, name="from admin")
    assert key.encode() in page.content and key.startswith(token.prefix)
    assert timedelta(days=4, hours=23) < token.expires_at - timezone.now() <= timedelta(days=5)
    assert as_token(key).get(JOBS).status_code == 200
    listing = admin_client.get("/admin/jobs/apitoken/")
    assert listing.status_code == 200 and token.prefix.encode() in listing.content
    assert key.encode() not in listing.content and token.digest.encode() not in listing.content
    detail = admin_client.get(f"/admin/jobs/apitoken/{token.pk}/change/")
    assert detail.status_code == 200 and token.prefix.encode() in detail.content
    assert key.encode() not in detail.content and token.digest.encode() not in detail.content
    done = admin_client.post("/admin/jobs/apitoken/", {"action": "revoke_tokens", "_selected_action": [token.pk]})
    assert done.status_code == 302
    assert as_token(key).get(JOBS).status_code == 401


def test_admin_tokens_are_staff_only():
    client = Client()
    client.force_login(user("mallory", password="pw"))
    response = client.get("/admin/jobs/apitoken/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


# --- the data migration --------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # SQLite's schema editor cannot run inside the test's transaction
def test_drf_authtoken_keys_are_converted_to_hashed_tokens_and_the_plain_table_dropped(settings):
    """Migration 0011 on a database that still has DRF's authtoken table: the same keys keep working."""
    import importlib

    from django.db.migrations.executor import MigrationExecutor

    migration = importlib.import_module("genserver.jobs.migrations.0011_api_tokens")
    alice = user()
    legacy = "0123456789abcdef0123456789abcdef01234567"  # DRF's form: 40 hex characters
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamp with time zone "
            "NOT NULL, user_id integer NOT NULL)"
            if connection.vendor == "postgresql"
            else "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created datetime NOT NULL, "
            "user_id integer NOT NULL)"
        )
        cursor.execute(
            "INSERT INTO authtoken_token (key, created, user_id) VALUES (%s, %s, %s)",
            [legacy, timezone.now() - timedelta(days=400), alice.pk],
        )
    apps = MigrationExecutor(connection).loader.project_state(("jobs", "0011_api_tokens")).apps
    try:
        with connection.schema_editor() as editor:
            migration.convert_authtoken_keys(apps, editor)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS authtoken_token")  # a failed run leaves nothing behind
    assert "authtoken_token" not in connection.introspection.table_names()
    converted = ApiToken.objects.get(user=alice)
    assert converted.digest == tokens.digest_of(legacy) and legacy not in (converted.prefix + converted.name)
    assert timedelta(days=settings.API_TOKEN_DAYS - 1) < converted.expires_at - timezone.now()
    assert as_token(legacy).get(JOBS).status_code == 200  # the deployed client's header, unchanged
    assert as_token(legacy, "Bearer").get(JOBS).status_code == 200


def test_a_token_id_past_the_columns_range_is_a_404():
    _, key = tokens.issue(user())
    assert as_token(key).delete(f"/api/v1/tokens/{10**30}/").status_code == 404


def test_the_schema_documents_the_token_endpoints_and_both_header_forms():
    schema = Client().get("/api/schema/", HTTP_ACCEPT="application/json").json()
    assert {"tokenAuth", "bearerAuth"} <= set(schema["components"]["securitySchemes"])
    listing, one = schema["paths"]["/api/v1/tokens/"], schema["paths"]["/api/v1/tokens/{token_id}/"]
    assert set(listing) == {"get", "post"} and set(one) == {"delete"}
    assert {"201", "400", "401"} <= set(listing["post"]["responses"])
    assert {"204", "401", "404"} <= set(one["delete"]["responses"])
    made = schema["components"]["schemas"]["ApiTokenCreated"]["properties"]
    assert "key" in made and "key" not in schema["components"]["schemas"]["ApiToken"]["properties"]
    assert schema["components"]["schemas"]["ApiTokenCreate"]["additionalProperties"] is False
