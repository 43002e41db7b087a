"""The scheduling simulator: the seed's table pinned, our policy's targets as far as they are met.

Run alone with `.venv/bin/python -m pytest tests/scheduling -q -p no:django`.
The figures are explained in docs/BENCHMARKS.md, "Scheduling policy (simulator)".
"""

from __future__ import annotations

from functools import cache

import pytest

from genserver.scheduling import simulator
from genserver.scheduling.admission import AdmissionLimits, Decision
from genserver.scheduling.classes import LONG, MEDIUM, SHORT, yields_to_equal_priority
from genserver.scheduling.pools import default_layout
from genserver.scheduling.simulator import (
    IMAGE,
    VIDEO,
    Request,
    SimConfig,
    SimResult,
    mixed_layout,
    pct,
    seed_simulate,
    seed_waits,
    seed_workload,
    service_policy_config,
    simulate,
    simulate_rate,
)

# The chapter's printed table: policy → (images P50, images P99, videos P50, videos P99), seconds.
SEED_TABLE = {"fcfs": (17, 473, 19, 423), "sjf": (2, 90, 23, 614), "pools": (0, 7, 152, 745)}
POLICIES = ("ours", "ours+yod")


@cache
def run(policy: str, rate: float) -> SimResult:
    return simulate_rate(rate, service_policy_config(yield_on_demand=policy == "ours+yod"))


@cache
def bounds(rate: float) -> tuple[float, float]:
    """(0.6 × pools' image P99, 1.1 × FCFS' video P99) on the seed's workload at `rate`."""
    return (
        0.6 * pct(seed_waits("pools", rate=rate)[IMAGE], 0.99),
        1.1 * pct(seed_waits("fcfs", rate=rate)[VIDEO], 0.99),
    )


# --------------------------------------------------------------------------- the seed's table


@pytest.mark.parametrize("policy", list(SEED_TABLE))
def test_seed_table_reproduced_exactly(policy):
    r = seed_simulate(policy)
    got = (r[IMAGE][0], r[IMAGE][1], r[VIDEO][0], r[VIDEO][1])
    assert tuple(f"{x:.0f}" for x in got) == tuple(str(x) for x in SEED_TABLE[policy])


def test_seed_table_raw_figures():
    assert seed_simulate("fcfs")[IMAGE] == pytest.approx((16.788, 472.957), abs=1e-3)
    assert seed_simulate("sjf")[VIDEO] == pytest.approx((22.549, 613.942), abs=1e-3)
    assert seed_simulate("pools")[VIDEO] == pytest.approx((152.201, 745.438), abs=1e-3)


def test_seed_workload_is_the_chapters():
    reqs = seed_workload()
    assert len(reqs) == 400 and sum(r.kind == IMAGE for r in reqs) == 314
    assert reqs[0] == Request(pytest.approx(31.0101185), IMAGE, 3.0)
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    assert {r.seconds for r in reqs if r.kind == IMAGE} == {2.0, 3.0, 6.0}
    assert {r.seconds for r in reqs if r.kind == VIDEO} == {120.0, 300.0}
    assert seed_workload() == reqs  # deterministic


# --------------------------------------------------------------------------- mechanics, by hand

# cache_gib=0: one model at a time, so every change of model is a switch (a card with no room for two).
ONE_CARD = dict(
    layout=mixed_layout(1, 0), chunk_seconds=4.0, checkpoint_seconds=0.2, switch_seconds=0.5, cache_gib=0.0, limits=None
)


def _by_arrival(result: SimResult, kind: str) -> list[tuple[float, float]]:
    c = result.classes[kind]
    return list(zip(c.waits, c.delays))


def test_an_image_preempts_a_video_at_its_next_chunk_boundary():
    reqs = [Request(0.0, VIDEO, 120.0), Request(1.0, IMAGE, 3.0)]
    r = simulate(reqs, SimConfig(**ONE_CARD))
    # The video's first chunk is one 2.4-s step plus a 0.1-s save; then the image switches model (0.5 s).
    [(img_wait, img_delay)] = _by_arrival(r, IMAGE)
    assert img_wait == pytest.approx(2.5 + 0.5 - 1.0) and img_delay == pytest.approx(img_wait)
    # The video pays 49 boundaries × 0.2 s, the image's 3 s and two switches.
    [(vid_wait, vid_delay)] = _by_arrival(r, VIDEO)
    assert vid_wait == 0.0 and vid_delay == pytest.approx(49 * 0.2 + 3.0 + 2 * 0.5)
    assert r.switches == 2 and r.republished == 49


def test_yield_on_demand_pays_checkpoints_only_when_preempted():
    reqs = [Request(0.0, VIDEO, 120.0), Request(1.0, IMAGE, 3.0)]
    r = simulate(reqs, SimConfig(**ONE_CARD, yield_on_demand=True, in_process_seconds=0.0))
    [(img_wait, _)] = _by_arrival(r, IMAGE)
    assert img_wait == pytest.approx(2.4 + 0.5 - 1.0)
    [(_, vid_delay)] = _by_arrival(r, VIDEO)
    assert vid_delay == pytest.approx(3.0 + 2 * 0.5 + 0.2)  # the image, two switches, one restore
    assert (r.republished, r.in_process) == (1, 48)
    alone = simulate([Request(0.0, VIDEO, 300.0)], SimConfig(**ONE_CARD, yield_on_demand=True, in_process_seconds=0.0))
    assert alone.classes[VIDEO].delays == [pytest.approx(0.0)]


def test_a_model_the_cards_cache_holds_costs_no_switch():
    reqs = [Request(0.0, VIDEO, 120.0), Request(1.0, IMAGE, 3.0), Request(10.0, IMAGE, 3.0)]
    held = simulate(reqs, SimConfig(**{**ONE_CARD, "cache_gib": 40.0}, yield_on_demand=True, in_process_seconds=0.0))
    # SDXL (4.78 GiB) loads once beside Wan (26.67 GiB); back to Wan and to SDXL again are free.
    assert held.switches == 1
    [(first_wait, _), (second_wait, _)] = _by_arrival(held, IMAGE)
    assert first_wait == pytest.approx(2.4 + 0.5 - 1.0)  # the load
    [(_, vid_delay)] = _by_arrival(held, VIDEO)
    assert vid_delay == pytest.approx(2 * 3.0 + 0.5 + 2 * 0.2)  # two images, one load, two restores
    # A budget under both (20 GiB < 31.45 GiB): the latest model only, every change a load.
    small = simulate(reqs, SimConfig(**{**ONE_CARD, "cache_gib": 20.0}, yield_on_demand=True, in_process_seconds=0.0))
    assert small.switches == 4
    assert small.classes[VIDEO].delays[0] == pytest.approx(vid_delay + 3 * 0.5)


def test_a_started_video_does_not_swap_cards_with_another_started_video():
    # Two cards in videos; an image takes card 0 at its first boundary, and video A's continuation waits.
    # Card 1 at its boundaries keeps video B (a swap would only pay a restore: both are started); A resumes on
    # card 0 after the image. The short class keeps first come, first served among equals (new jobs share it).
    reqs = [Request(0.0, VIDEO, 120.0), Request(0.0, VIDEO, 120.0), Request(1.0, IMAGE, 3.0)]
    cfg = SimConfig(**{**ONE_CARD, "layout": mixed_layout(2, 0)}, yield_on_demand=True, in_process_seconds=0.0)
    r = simulate(reqs, cfg)
    assert r.republished == 1  # A, for the image; no swap
    assert sorted(r.classes[VIDEO].delays) == [pytest.approx(0.0), pytest.approx(3.0 + 2 * 0.5 + 0.2)]
    assert not yields_to_equal_priority(LONG) and not yields_to_equal_priority(MEDIUM)
    assert yields_to_equal_priority(SHORT)


def test_started_video_finishes_before_a_new_one_starts():
    reqs = [Request(0.0, VIDEO, 120.0), Request(0.5, VIDEO, 120.0), Request(1.0, IMAGE, 2.0)]
    r = simulate(reqs, SimConfig(**ONE_CARD))
    waits = r.classes[VIDEO].waits
    first_done = 120.0 + 49 * 0.2 + 2.0 + 2 * 0.5  # the first video's completion
    assert sorted(waits) == [0.0, pytest.approx(first_done - 0.5)]


def test_a_chunk_is_never_shorter_than_a_step_and_an_image_runs_whole():
    reqs = [Request(0.0, VIDEO, 300.0), Request(1.0, IMAGE, 2.0)]
    r = simulate(reqs, SimConfig(**{**ONE_CARD, "chunk_seconds": 1.0}))
    [(img_wait, _)] = _by_arrival(r, IMAGE)
    assert img_wait == pytest.approx(6.0 + 0.1 + 0.5 - 1.0)  # one 6-s step, its save, the switch
    single = simulate([Request(0.0, IMAGE, 2.0)], SimConfig(**ONE_CARD))
    assert single.classes[IMAGE].delays == [0.0] and single.republished == 0


def test_layout_and_cap_bound_the_cards_running_video():
    reqs = seed_workload(rate=0.08)
    assert simulate(reqs, SimConfig(layout=default_layout(4, image_cards=1))).max_long_cards == 3
    assert simulate(reqs, SimConfig(layout=default_layout(4))).max_long_cards == 4  # every card takes video
    assert simulate(reqs, SimConfig(layout=mixed_layout(4, 0))).max_long_cards == 4
    assert simulate(reqs, SimConfig(layout=mixed_layout(4, 0), long_cap=2)).max_long_cards == 2


def test_the_simulator_asks_admission(monkeypatch):
    def refuse(queue, priority, items, layout, limits, wind=None):
        return Decision(False, 1e9, 1.0, 1, "test")

    monkeypatch.setattr(simulator.engine, "decide", refuse)  # the module that runs the arrivals
    r = simulate_rate(0.06, SimConfig())
    assert r.classes[IMAGE].refused + r.classes[VIDEO].refused == 400
    assert r.classes[IMAGE].waits == [] and r.classes[VIDEO].waits == []


def test_simulation_is_deterministic_and_rejects_unsorted_input():
    assert run("ours", 0.06).summary("delay") == simulate_rate(0.06, service_policy_config()).summary("delay")
    with pytest.raises(ValueError):
        simulate([Request(5.0, IMAGE, 2.0), Request(1.0, IMAGE, 2.0)])


# --------------------------------------------------------------------------- our policy's targets


@pytest.mark.parametrize("rate", [0.06, 0.08])
def test_no_seed_policy_is_good_for_both_classes(rate):
    image_bound, video_bound = bounds(rate)
    fcfs, pools = seed_simulate("fcfs", rate=rate), seed_simulate("pools", rate=rate)
    assert fcfs[IMAGE][1] > 50 * image_bound  # FCFS starves images
    assert pools[VIDEO][1] > 1.5 * video_bound  # pools starve video


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("rate", [0.06, 0.08])
@pytest.mark.parametrize("metric", ["wait", "delay"])
def test_images_p99_within_six_tenths_of_pools(policy, rate, metric):
    r = run(policy, rate)
    assert r.classes[IMAGE].p(metric, 0.99) <= bounds(rate)[0]
    assert r.classes[IMAGE].refused == 0 and r.classes[VIDEO].refused == 0


# What the videos actually get (seed 0): ours 1.17-1.22 × FCFS' P99 on the wait, 1.24-1.26 × on the delay;
# with yield on demand (as the service runs) 1.07-1.10 × and 1.11-1.13 ×. Even with no overhead it is
# 1.06-1.07 × and 1.11-1.14 ×: giving images priority costs the backlogged videos the image work that
# arrives while they wait. Over 20 seeds the medians are within 1.1 × (docs/BENCHMARKS.md).
ACHIEVED_VIDEO_FACTOR = {"ours": 1.3, "ours+yod": 1.15}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("rate", [0.06, 0.08])
@pytest.mark.parametrize("metric", ["wait", "delay"])
def test_videos_p99_as_achieved(policy, rate, metric):
    r = run(policy, rate)
    fcfs = pct(seed_waits("fcfs", rate=rate)[VIDEO], 0.99)
    pools = pct(seed_waits("pools", rate=rate)[VIDEO], 0.99)
    p99 = r.classes[VIDEO].p(metric, 0.99)
    assert p99 <= ACHIEVED_VIDEO_FACTOR[policy] * fcfs
    assert p99 <= 0.75 * pools  # far better than the pools that protect images as well


def _missed_on_seed_0(reason: str):
    return pytest.mark.xfail(
        strict=True,
        reason=f"target missed on seed 0: {reason} (docs/BENCHMARKS.md); strict, so meeting it shows up here",
    )


VIDEO_TARGET_CASES = [
    pytest.param("ours+yod", 0.06, "wait"),
    pytest.param("ours+yod", 0.06, "delay", marks=_missed_on_seed_0("1.106 × FCFS' P99")),
    pytest.param("ours+yod", 0.08, "wait", marks=_missed_on_seed_0("1.103 × FCFS' P99")),
    pytest.param("ours+yod", 0.08, "delay", marks=_missed_on_seed_0("1.132 × FCFS' P99")),
    *(
        pytest.param("ours", rate, metric, marks=_missed_on_seed_0("1.17-1.26 × without yield on demand"))
        for rate in (0.06, 0.08)
        for metric in ("wait", "delay")
    ),
]


@pytest.mark.parametrize("policy, rate, metric", VIDEO_TARGET_CASES)
def test_videos_p99_within_eleven_tenths_of_fcfs(policy, rate, metric):
    assert run(policy, rate).classes[VIDEO].p(metric, 0.99) <= bounds(rate)[1]


# --------------------------------------------------------------------------- overload


@pytest.mark.parametrize("policy", POLICIES)
def test_overload_refuses_video_first_and_no_image(policy):
    r = run(policy, 0.12)
    assert r.classes[IMAGE].refused == 0 and r.classes[IMAGE].accepted == 314
    assert r.classes[VIDEO].refused >= 10
    # Accepted videos start within their class's limit.
    assert max(r.classes[VIDEO].waits) <= AdmissionLimits().long
    assert r.cap_engaged_share > 0  # the long cap engaged under overload (and never at 0.06 / 0.08)
    assert run(policy, 0.06).cap_engaged_share == run(policy, 0.08).cap_engaged_share == 0


def test_overload_accepted_videos_start_within_their_limit_on_twenty_workloads():
    # Admission's headwind (the better classes' share of the cards, the boundary cost): without it, 5 of
    # these 20 workloads started an accepted video after the limit (up to 1,832 s with the image card).
    latest = [max(simulate_rate(0.12, service_policy_config(), seed=s).classes[VIDEO].waits) for s in range(20)]
    assert max(latest) <= AdmissionLimits().long, latest


# Seed 0, images P99 wait/delay: ours 3.02/3.63 s at 0.12 against 3.10/3.10 s at 0.06 (a video's chunk
# boundary that an image waits for); with yield on demand 2.81/2.87 against 3.13/3.58.
@pytest.mark.parametrize(
    "policy",
    ["ours+yod", pytest.param("ours", marks=_missed_on_seed_0("ours's delay 3.63 s against 3.10 s at 0.06"))],
)
def test_overload_images_p99_no_worse_than_at_006(policy):
    for metric in ("wait", "delay"):
        assert run(policy, 0.12).classes[IMAGE].p(metric, 0.99) <= run(policy, 0.06).classes[IMAGE].p(metric, 0.99)


def test_overload_images_p99_as_achieved_without_yield_on_demand():
    for metric in ("wait", "delay"):
        assert run("ours", 0.12).classes[IMAGE].p(metric, 0.99) <= 1.2 * run("ours", 0.06).classes[IMAGE].p(
            metric, 0.99
        )
