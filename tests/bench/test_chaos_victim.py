"""bench.chaos: which worker a kill picks (the drill's victims), on real job rows and stand-ins for the processes."""

from __future__ import annotations

import random
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from bench import chaos
from genserver.jobs import services
from genserver.jobs.models import Job, JobStatus

pytestmark = pytest.mark.django_db

WORKERS = ("card0", "card1", "decode")


def target() -> chaos.Target:
    """Three running workers (stand-ins for the supervisor's children and the layout)."""
    running = SimpleNamespace(poll=lambda: None)
    supervisor = SimpleNamespace(children=[SimpleNamespace(name=f"worker {w}", process=running) for w in WORKERS])
    layout = SimpleNamespace(workers=[SimpleNamespace(name=w) for w in WORKERS])
    return chaos.Target(supervisor, layout, [])


def leased_job(owner, worker: str, expires_in: float) -> Job:
    request = {"model": "tiny-sd", "prompt": "victim", "width": 64, "height": 64, "num_frames": 1}
    job = services.submit_job(owner, request | {"steps": 4, "guidance_scale": 5.0, "seed": 1, "num_outputs": 1})
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.DENOISING,
        lease_owner=f"{worker}@node",
        lease_expires_at=timezone.now() + timedelta(seconds=expires_in),
    )
    return job


def test_a_card_holding_a_job_is_a_victim_although_its_heartbeat_lapsed(make_user, monkeypatch):
    monkeypatch.setattr(chaos, "live_names", lambda: {"decode"})  # the loaded card's heartbeat is stale
    leased_job(make_user("victim").user, "card0", expires_in=60)
    picks = {chaos.choose_victim(target(), random.Random(seed), max_attempts=5, prefer_busy=1.0) for seed in range(20)}
    assert picks == {("card0", True)}  # never card1: no heartbeat, no lease


def test_an_expired_lease_makes_no_victim_of_the_restarted_worker(make_user, monkeypatch):
    monkeypatch.setattr(chaos, "live_names", lambda: {"decode"})
    leased_job(make_user("expired").user, "card0", expires_in=-1)  # its worker was killed; the reaper is due
    picks = {chaos.choose_victim(target(), random.Random(seed), max_attempts=5, prefer_busy=1.0) for seed in range(20)}
    assert picks == {("decode", False)}
