"""The overload cap in the live service (services/overload.py, selectors.long_cap_state / must_leave_long).

Two live cards (their heartbeats stood in for), a long backlog: beat's tick
engages the cap, admission and /queues count one card for the long class, a
worker meets the cap while the other card runs long work; the backlog gone,
the next tick lets go.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from genserver import liveness
from genserver.jobs import selectors, services
from genserver.jobs.models import Job, JobStatus
from genserver.redis_client import LONG_CAP_KEY, client
from tests.conftest import submit
from tests.support.jobs import make_job

pytestmark = pytest.mark.django_db

VIDEO = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 81, "steps": 20}  # long, a new job's band
LIVE = [
    {"name": "gpu0@n1", "queues": ["short", "medium", "long"]},
    {"name": "gpu1@n1", "queues": ["short", "medium", "long"]},
    {"name": "encode@n1", "queues": ["encode", "control", "webhooks"]},
    {"name": "decode@n1", "queues": ["decode"]},
]


@pytest.fixture
def two_cards(monkeypatch, settings):
    monkeypatch.setattr(liveness, "payloads", lambda answer: LIVE)  # whatever the workers of the session beat
    client().delete(LONG_CAP_KEY)
    yield
    client().delete(LONG_CAP_KEY)


def test_a_long_backlog_engages_the_cap_and_its_end_lets_go(api, make_user, two_cards, long_limit):
    owner = make_user("videos").user
    backlog = [make_job(owner, VIDEO) for _ in range(3)]
    work = sum(j.estimated_seconds * j.clock_scale for j in backlog)  # wall seconds, over two cards
    long_limit(1.5 * work / 2)  # the wait (work / 2) is 2/3 of the limit: above 0.5, accepted
    assert not selectors.long_cap_state().engaged  # nothing decided yet: off
    services.update_long_cap()  # beat's tick
    state = selectors.long_cap_state()
    assert state.engaged and state.cap == 1 and state.long_cards == 2, state
    assert state.long_wait_seconds == pytest.approx(work / 2, rel=0.02) and state.changed_at
    assert client().pttl(LONG_CAP_KEY) > 0  # a stopped beat lets go of it

    # Admission and the queue picture count one card for the long class while it holds.
    queues = {q["name"]: q for q in api.get("/api/v1/queues/").json()}
    assert queues["long"]["capped"] is True and queues["long"]["cards"] == 1
    assert queues["short"]["capped"] is False and queues["short"]["cards"] == 2
    refused = submit(api, **VIDEO, prompt="one more")
    assert refused.status_code == 429, refused.content  # work / 1 card > the limit
    assert refused.json()["expected_wait_seconds"] == pytest.approx(work, rel=0.02)

    # A worker meets the cap while another card runs long work, not while it runs none.
    running = backlog[0]
    Job.objects.filter(pk=running.pk).update(
        status=JobStatus.DENOISING, lease_owner="gpu1@n1:7", lease_expires_at=timezone.now() + timedelta(seconds=30)
    )
    assert selectors.must_leave_long("gpu0@n1:5")
    assert not selectors.must_leave_long("gpu1@n1:7")  # its own lease is not another card
    Job.objects.filter(pk=running.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert not selectors.must_leave_long("gpu0@n1:5")  # a lapsed lease runs nothing
    Job.objects.filter(pk=running.pk).update(status=JobStatus.QUEUED, lease_owner="", lease_expires_at=None)

    # Hysteresis: a wait between the release and engage shares keeps it; below release, it lets go.
    Job.objects.filter(pk=backlog[2].pk).delete()  # the wait is now 2/3 × 2/3 = 0.44 of the limit
    assert services.update_long_cap().engaged
    Job.objects.filter(pk__in=[j.pk for j in backlog]).delete()
    assert not services.update_long_cap().engaged
    queues = {q["name"]: q for q in api.get("/api/v1/queues/").json()}
    assert queues["long"]["capped"] is False and queues["long"]["cards"] == 2


def test_one_card_is_never_capped_and_the_cap_can_be_turned_off(
    make_user, two_cards, monkeypatch, settings, long_limit
):
    owner = make_user("videos").user
    for _ in range(3):
        make_job(owner, VIDEO)
    long_limit(0.001)  # far over any share of the limit
    settings.LONG_CAP_ENGAGE_SHARE = 0
    assert not services.update_long_cap().engaged
    settings.LONG_CAP_ENGAGE_SHARE = 0.5
    monkeypatch.setattr(liveness, "payloads", lambda answer: [LIVE[0], *LIVE[2:]])
    state = services.update_long_cap()
    assert not state.engaged and state.long_cards == 1  # capping the only card would stop video altogether
