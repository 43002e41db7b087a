"""The fair window in the simulator (bench/fairness.py's scenario) and the policy's rules (scheduling/fairness.py)."""

from __future__ import annotations

import pytest

from bench import fairness as bench
from genserver.scheduling.fairness import (
    DEFAULT_FAIR_WINDOW,
    FairWindow,
    ahead_priority,
    held_jobs_ahead,
    next_held,
    release_key,
)
from genserver.scheduling.simulator import IMAGE, Request, service_policy_config, simulate


def test_the_window_holds_a_burst_never_the_lightest_user():
    window = FairWindow(2)
    assert not window.holds(1, 1)  # room in the window
    assert window.holds(2, 2)  # alone beyond the window: held
    assert window.holds(2, 300, [4])  # the burst: held while another user has fewer waiting
    assert not window.holds(5, 5, [300])  # the light user: published, however many it has waiting
    assert window.holds(2, 300, [300])  # two equal bursts: both held, served alternately
    assert window.room(0) == 2 and window.room(3) == 0
    off = FairWindow(0)
    assert not off.holds(1000, 1000) and off.room(1000) == float("inf")
    with pytest.raises(ValueError):
        FairWindow(-1)


def test_the_lightest_user_goes_one_step_ahead_inside_its_band_only():
    window = FairWindow(1)
    assert window.goes_ahead(0, [1]) and window.goes_ahead(5, [297])  # fewer unstarted than every other user
    assert not window.goes_ahead(0, [])  # alone: nobody to go ahead of
    assert not window.goes_ahead(3, [3, 10])  # not lighter than every other
    assert not FairWindow(0).goes_ahead(0, [300])  # the window off: first-come
    assert ahead_priority(2, "short") == 1
    assert ahead_priority(0, "short") == 0  # the band's first priority stays
    assert ahead_priority(5, "medium") == 4 and ahead_priority(4, "medium") == 4
    assert ahead_priority(7, "long") == 6 and ahead_priority(6, "long") == 6  # never into the medium band


def test_held_jobs_leave_best_priority_first_then_oldest():
    held = [(3, 1.0), (2, 5.0), (2, 4.0)]
    assert next_held(held, key=lambda j: release_key(*j)) == (2, 4.0)
    assert next_held([], key=lambda j: release_key(*j)) is None
    assert held_jobs_ahead(0, 1) == 0  # alone: nobody else's turn comes first
    assert held_jobs_ahead(2, 3) == 2 + 3 * 2  # two own ahead, and two other users' turn for each, and its own


@pytest.fixture(scope="module")
def rows():
    return bench.simulate_scenarios(DEFAULT_FAIR_WINDOW)


def test_b_keeps_its_latency_behind_a_burst_under_the_window_and_not_first_come(rows):
    alone = rows["B alone"]
    fair = rows[f"A + B, fair (window {DEFAULT_FAIR_WINDOW})"]
    fcfs = rows["A + B, first-come (window 0)"]
    assert alone.b_wait[1] > 0.5  # B alone already waits: the cards are half busy with its own images
    # Measured (seed 0): wait P99 1.55× alone, latency P99 1.22× (3.3× and 1.9× before the lightest user's
    # job went one step ahead of A's messages and cut one of A's chunks after a second of waiting);
    # first-come 88× and 35×.
    assert fair.b_wait[1] <= 2.0 * alone.b_wait[1]
    assert fair.b_latency[1] <= 2.0 * alone.b_latency[1]
    assert fcfs.b_latency[1] >= 10 * alone.b_latency[1]
    assert fair.b_wait[1] <= 0.1 * fcfs.b_wait[1]


def test_only_a_job_placed_ahead_cuts_a_chunk_and_only_after_it_has_waited():
    a, b = bench.user_a(n=40), bench.user_b(duration=120.0)
    config = service_policy_config(4, limits=None, fair_window=1, **bench.AS_THE_SERVICE_RUNS)
    assert simulate(bench.merged(a, b), config).cuts > 0
    assert simulate(a, config).cuts == 0  # one user: nobody is placed ahead
    never = service_policy_config(4, limits=None, fair_window=1, cut_chunks=False, **bench.AS_THE_SERVICE_RUNS)
    at_once = service_policy_config(4, limits=None, fair_window=1, cut_after=0.0, **bench.AS_THE_SERVICE_RUNS)
    assert simulate(bench.merged(a, b), never).cuts == 0
    assert simulate(bench.merged(a, b), at_once).cuts > simulate(bench.merged(a, b), config).cuts


def test_a_burst_drains_with_no_card_idle_while_it_waits(rows):
    fair = rows[f"A + B, fair (window {DEFAULT_FAIR_WINDOW})"]
    assert fair.a_drain <= 1.03 * fair.bound
    alone = rows["A alone"]
    assert alone.a_drain <= 1.03 * alone.bound


def test_shortest_first_between_bands_holds_under_the_window():
    """A user's held jobs leave best priority first: their 2-s images submitted after a burst of 6-s ones
    start before the burst's waiting 6-s images (a better band), not after all of them."""
    burst = [Request(0.0, IMAGE, 6.0, user="A") for _ in range(40)]
    short = [Request(1.0, IMAGE, 2.0, user="A") for _ in range(4)]
    part = simulate(burst + short, service_policy_config(4, limits=None, fair_window=2)).users["A"]
    by_size: dict[float, list[float]] = {2.0: [], 6.0: []}
    for wait, latency in zip(part.waits, part.latencies, strict=True):
        by_size[2.0 if latency - wait < 3.0 else 6.0].append(wait)
    assert len(by_size[2.0]) == 4
    assert max(by_size[2.0]) < 20.0  # behind a few chunks of the window's, not the 40
    assert max(by_size[6.0]) > 40.0
