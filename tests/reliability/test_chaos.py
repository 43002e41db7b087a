"""1. Worker faults under load: the chaos drill (bench/chaos.py), short, on the test stack.

The long run is `python -m bench.chaos` (docs/RELIABILITY.md); this one offers a
mixed workload for a dozen seconds while SIGKILLing the card, encode and decode
workers, and holds the same bar: every accepted job ends succeeded or
cancelled, nothing is lost or stuck, no chunk or decode runs twice to
completion, and a resumed job redoes at most the interrupted chunk.
"""

from __future__ import annotations

import random

import pytest

from bench.chaos import Target, drill, workload
from tests.reliability.conftest import django_api, revive

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]


def test_chaos_drill_loses_and_duplicates_nothing(stack, make_user):
    users = [make_user(f"chaos{i}") for i in range(3)]
    rng = random.Random(11)
    offers = workload(jobs=24, seconds=12.0, users=len(users), rng=rng)
    report = drill(
        Target(stack.supervisor, stack.layout, [django_api(u) for u in users]),
        offers,
        seconds=12.0,
        kill_every=3.0,
        rng=rng,
        drain=60.0,
        say=print,
        prefer_busy=0.9,
    )
    revive(stack)
    print("\n".join(report.lines()))
    # Enough accepted work to kill cards mid-job. Not more: a killed card stops counting for admission
    # once its heartbeat lapses (3 s under the tests' 3 s lease), and until it is back admission refuses
    # the classes it served, as it should with no card to run them (seen: 10 of 24 accepted).
    assert report.accepted >= 6, report.lines()
    assert report.lost == 0 and report.stuck == 0, report.problems
    assert report.failed == 0, report.problems
    assert report.finished == report.accepted
    assert report.duplicated == 0, report.problems
    assert report.redo_violations == 0, report.problems
    assert sum(report.kills.values()) >= 3 and report.kills_holding_a_job >= 1, report.kills
    assert not report.other_responses, report.problems  # only 201s and 429s
