"""The API processes' copies of token and quota rows (selectors/access.py): used while Redis's generation holds,
ended by every change to those rows from its commit on, never used with Redis down, bounded in age and number."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from genserver.jobs import selectors
from genserver.jobs.models import ApiToken, Quota
from genserver.jobs.selectors import access
from genserver.jobs.services import tokens
from genserver.redis_client import ACCESS_GENERATION_KEY

pytestmark = pytest.mark.django_db
JOBS = "/api/v1/jobs/"


def statements_on(table: str, run) -> int:
    """How many statements `run()` sends that name `table`."""
    with CaptureQueriesContext(connection) as captured:
        run()
    return sum(table in query["sql"] for query in captured.captured_queries)


def as_token(key: str) -> APIClient:
    return APIClient(HTTP_AUTHORIZATION=f"Token {key}")


class Loads:
    """A loader that counts its calls and returns the current value."""

    def __init__(self, value: object = "first") -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> object:
        self.calls += 1
        return self.value


def test_a_token_and_a_quota_are_read_once_then_taken_from_the_copy():
    alice = get_user_model().objects.create_user("alice")
    _, key = tokens.issue(alice)
    token_table, quota_table = ApiToken._meta.db_table, Quota._meta.db_table
    assert statements_on(token_table, lambda: as_token(key).get(JOBS)) >= 1
    assert statements_on(token_table, lambda: as_token(key).get(JOBS)) == 0  # the copy, checked against Redis
    assert statements_on(quota_table, lambda: selectors.effective_quota(alice)) == 1
    assert statements_on(quota_table, lambda: selectors.effective_quota(alice)) == 0


def test_another_processs_commit_ends_the_copy_here(redis_conn):
    """What another API process's revoke does to this one: its commit replaces the generation in Redis; this
    process's own copies are untouched, and still not used."""
    token, key = tokens.issue(get_user_model().objects.create_user("bob"))
    assert as_token(key).get(JOBS).status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())  # the row, as the other process wrote it
    redis_conn.set(ACCESS_GENERATION_KEY, "moved by another process")  # and its commit's move
    refused = as_token(key).get(JOBS)
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]


def test_a_copy_made_between_the_move_and_the_commit_ends_at_the_commit(django_capture_on_commit_callbacks):
    """The move at the change and the move at its commit: a reader that read the old rows in between (the change
    not yet committed) kept them under the first move's generation, which the commit's move replaces."""
    loads = Loads("the old row")
    with django_capture_on_commit_callbacks(execute=True):
        access.forget()  # a revoke's change, not yet committed
        assert access.read_through("test", "k", loads) == "the old row"  # another reader, before the commit
        loads.value = "the committed row"
        assert access.read_through("test", "k", loads) == "the old row"  # the copy, until the commit
    assert access.read_through("test", "k", loads) == "the committed row" and loads.calls == 2


def test_the_admins_edits_end_the_copies_of_quotas():
    alice = get_user_model().objects.create_user("carol")
    team = Group.objects.create(name="team")
    assert selectors.effective_quota(alice).source == "default"
    alice.groups.add(team)
    row = Quota.objects.create(group=team, max_jobs_in_flight=3)  # a new row
    assert (selectors.effective_quota(alice).source, selectors.effective_quota(alice).max_jobs_in_flight) == (
        "groups: team",
        3,
    )
    row.max_jobs_in_flight = 4
    row.save()  # an edit
    assert selectors.effective_quota(alice).max_jobs_in_flight == 4
    alice.groups.remove(team)  # a membership
    assert selectors.effective_quota(alice).source == "default"
    alice.groups.add(team)
    assert selectors.effective_quota(alice).source == "groups: team"
    team.delete()  # the group, its row with it
    assert selectors.effective_quota(alice).source == "default"
    Quota.objects.create(user=alice, max_jobs_in_flight=1)
    assert selectors.effective_quota(alice).source == "user"
    Quota.objects.get(user=alice).delete()
    assert selectors.effective_quota(alice).source == "default"


def test_a_quotas_defaults_are_the_settings_of_the_moment(settings):
    alice = get_user_model().objects.create_user("dave")
    settings.MAX_JOBS_IN_FLIGHT = 5
    assert selectors.effective_quota(alice).max_jobs_in_flight == 5
    settings.MAX_JOBS_IN_FLIGHT = 6  # the copy holds rows, not limits
    assert selectors.effective_quota(alice).max_jobs_in_flight == 6


def test_with_redis_down_nothing_is_copied_and_the_rows_are_read_every_time(monkeypatch):
    def down():
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(access, "redis_client", down)
    loads = Loads()
    for _ in range(3):
        assert access.read_through("test", "k", loads) == "first"
    assert loads.calls == 3
    access.forget()  # a change with Redis down: no error


def test_a_flushed_redis_gets_a_new_generation_and_old_copies_are_not_used(redis_conn):
    loads = Loads()
    access.read_through("test", "k", loads)
    before = redis_conn.get(ACCESS_GENERATION_KEY)
    redis_conn.delete(ACCESS_GENERATION_KEY)
    access.read_through("test", "k", loads)
    assert loads.calls == 2 and redis_conn.get(ACCESS_GENERATION_KEY) not in (None, before)


def test_a_copy_is_used_at_most_the_settings_seconds_and_never_with_zero(settings, monkeypatch):
    """The bound for a change whose move could not reach Redis: the generation holds, the copy ages out."""
    settings.ACCESS_CACHE_SECONDS = 30
    clock = [1000.0]
    monkeypatch.setattr(access.time, "monotonic", lambda: clock[0])
    loads = Loads()
    access.read_through("test", "k", loads)
    clock[0] += 29
    access.read_through("test", "k", loads)
    assert loads.calls == 1
    clock[0] += 2
    access.read_through("test", "k", loads)
    assert loads.calls == 2
    settings.ACCESS_CACHE_SECONDS = 0
    access.read_through("test", "k", loads)
    access.read_through("test", "k", loads)
    assert loads.calls == 4


def test_a_failed_load_keeps_nothing_and_the_copies_are_bounded(monkeypatch):
    def refused():
        raise tokens.TokenRefused("Invalid token.")

    with pytest.raises(tokens.TokenRefused):
        access.read_through("test", "unknown", refused)
    loads = Loads()
    access.read_through("test", "unknown", loads)
    assert loads.calls == 1  # nothing was kept for the refusal
    monkeypatch.setattr(access, "MAX_COPIES", 4)
    for index in range(5):
        access.read_through("test", index, Loads(index))
    again = Loads()
    access.read_through("test", 4, again)
    access.read_through("test", 0, again)
    assert again.calls == 1  # the newest was kept, the oldest let go


def test_each_request_gets_instances_of_its_own():
    _, key = tokens.issue(get_user_model().objects.create_user("erin"))
    first, second = tokens.authenticate(key), tokens.authenticate(key)
    assert first.pk == second.pk and first is not second and first.user is not second.user
    first.user.is_staff = True  # a request's change to its user is no other request's
    assert tokens.authenticate(key).user.is_staff is False


def test_a_request_checks_its_copies_against_one_read_of_the_generation(redis_conn, monkeypatch):
    alice = get_user_model().objects.create_user("erin")
    _, key = tokens.issue(alice)
    as_token(key).post(JOBS, {"model": "sdxl-sim", "prompt": "warm the copies"}, format="json")
    reads: list[bytes | None] = []
    real = access._read_generation

    def counted() -> bytes | None:
        reads.append(real())
        return reads[-1]

    monkeypatch.setattr(access, "_read_generation", counted)
    response = as_token(key).post(JOBS, {"model": "sdxl-sim", "prompt": "a submit"}, format="json")
    assert response.status_code == 201, response.content
    assert len(reads) == 1  # the token's copy and the quota's, one GET
    access.read_through("test", "k", Loads())  # outside any request: its own read
    assert len(reads) == 2


def test_a_change_inside_a_request_makes_its_later_copies_read_the_moved_generation(redis_conn):
    loads = Loads("the old row")
    with access.per_request():
        assert access.read_through("test", "k", loads) == "the old row"
        before = redis_conn.get(ACCESS_GENERATION_KEY)
        access.forget()  # a revoke within the same request
        loads.value = "the new row"
        assert access.read_through("test", "k", loads) == "the new row" and loads.calls == 2
        assert access._request_generation.get() == redis_conn.get(ACCESS_GENERATION_KEY) != before
    assert access._request_generation.get() is None  # the scope ends with the request
