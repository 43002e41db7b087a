"""Card groups: the seed's one-request-per-group-of-cards trade-off, in the layout and the simulator."""

from __future__ import annotations

import json

import pytest

from genserver.scheduling.admission import AdmissionLimits, WorkItem, decide, expected_wait
from genserver.scheduling.pools import (
    GROUP_EFFICIENCY,
    INTERACTIVE,
    WorkerSpec,
    class_of,
    default_layout,
    group_speedup,
    load_layout,
)
from genserver.scheduling.simulator import (
    SEED_VIDEO_SECONDS,
    VIDEO,
    Request,
    SimConfig,
    group_layout,
    group_layouts,
    group_table,
    simulate,
    simulate_groups,
    video_workload,
)

# The seed's printed table for 8 cards: (cards per group, latency minutes, videos per hour).
SEED_GROUP_TABLE = [(1, 25.0, 19.2), (2, 13.2, 18.2), (4, 7.1, 16.9), (8, 3.9, 15.4)]


def test_group_table_is_the_seeds() -> None:
    rows = group_table()
    assert [(r.group, round(r.latency_minutes, 1), round(r.videos_per_hour, 1)) for r in rows] == SEED_GROUP_TABLE
    assert [r.groups for r in rows] == [8, 4, 2, 1]


def test_group_speedup_and_size() -> None:
    assert GROUP_EFFICIENCY == {1: 1.0, 2: 0.95, 4: 0.88, 8: 0.80}
    assert group_speedup(4) == pytest.approx(3.52)
    with pytest.raises(ValueError, match="group of 3"):
        group_speedup(3)
    assert WorkerSpec("g", ("long",), devices=(0, 1, 2, 3)).group_size == 4
    assert WorkerSpec("c", ("long",)).group_size == 1


def _lone_job_seconds(group: int) -> float:
    cfg = SimConfig(layout=group_layout([group]), limits=None, checkpoint_seconds=0.0, steps={SEED_VIDEO_SECONDS: 50})
    return simulate([Request(0.0, VIDEO, SEED_VIDEO_SECONDS)], cfg).classes[VIDEO].latencies[0]


def test_group_of_4_finishes_a_lone_job_3_5x_faster() -> None:
    single, group = _lone_job_seconds(1), _lone_job_seconds(4)
    assert single == pytest.approx(SEED_VIDEO_SECONDS)
    assert single / group == pytest.approx(3.52)


def test_simulated_layouts() -> None:
    assert list(group_layouts(8)) == [
        "8×1",
        "4×2",
        "2×4",
        "1×8",
        "pooled: 1×4 + 4×1",
        "pooled, routed: 1×4 interactive + 4×1",
    ]
    first = simulate_groups()
    results = {r.layout: r for r in first}
    assert results["8×1"].capacity_per_hour == pytest.approx(19.2)
    assert results["1×8"].load == pytest.approx(0.875)
    # larger groups: lower median latency; the whole machine as one group queues the most
    assert results["2×4"].p50_minutes < results["4×2"].p50_minutes < results["8×1"].p50_minutes
    assert results["1×8"].p99_minutes > results["2×4"].p99_minutes
    assert simulate_groups() == first  # deterministic


# --------------------------------------------------------------------------- layout: a group on a lane


def test_default_layout_with_a_group_on_the_interactive_lane() -> None:
    layout = default_layout(num_gpus=8, group_cards=4)
    group = layout.workers[0]
    assert (group.name, group.devices, group.lane, group.group_size) == ("group0", (0, 1, 2, 3), INTERACTIVE, 4)
    assert group.consumed_queues() == ("short@interactive", "medium@interactive", "long@interactive")
    singles = [w for w in layout.workers if w.denoises and not w.lane]
    assert [w.devices for w in singles] == [(4,), (5,), (6,), (7,)]
    assert all(w.queues == ("short", "medium", "long") for w in singles)  # every single takes every class
    # Routing: the lane's queue where a worker serves it, else the class queue.
    assert layout.queue_for("long", "wan-sim", INTERACTIVE) == "long@interactive"
    assert layout.queue_for("long", "wan-sim") == "long"
    assert layout.queue_for("long", "wan-sim", "batch") == "long"  # no worker on that lane
    assert class_of("long@interactive") == "long" and layout.lanes() == {INTERACTIVE}
    # Capacity in card-equivalents: the group counts group_speedup(4) = 3.52, a job on it runs 3.52× faster.
    assert layout.card_equivalents("long@interactive") == pytest.approx(3.52)
    assert layout.card_equivalents("long") == 4 and layout.card_equivalents("short") == 4
    assert layout.job_speedup("long@interactive") == pytest.approx(3.52) and layout.job_speedup("long") == 1.0
    assert load_layout(json.dumps(layout.to_dict()), num_gpus=8) == layout  # the lane survives a round trip


def test_group_layout_on_cpu_and_refusals() -> None:
    cpu = default_layout(num_gpus=0, cpu_workers=2, group_cards=2)
    assert [w.name for w in cpu.workers] == ["group0", "cpu0", "cpu1", "encode", "decode"]
    assert cpu.workers[0].devices == () and cpu.workers[0].speedup == 1.0  # CPU: one device, no speedup
    with pytest.raises(ValueError, match="group_cards must be one of"):
        default_layout(num_gpus=8, group_cards=3)
    with pytest.raises(ValueError, match="at least one"):
        default_layout(num_gpus=4, group_cards=4)
    with pytest.raises(ValueError, match="group of 3"):
        WorkerSpec("g", ("long",), devices=(0, 1, 2))
    with pytest.raises(ValueError, match="either a lane or models"):
        WorkerSpec("g", ("long",), lane="fast", models=("wan-sim",))
    with pytest.raises(ValueError, match="lane 'long'"):
        WorkerSpec("g", ("long",), lane="long")
    # Work without a lane must have a worker outside the lanes.
    with pytest.raises(ValueError, match="without a worker"):
        load_layout(
            '{"workers": [{"name": "g", "queues": ["short", "medium", "long"], "devices": [0, 1],'
            ' "lane": "interactive"}, {"name": "s", "queues": ["short", "medium", "encode", "decode"]}]}',
            num_gpus=2,
        )
    # ... while its stage queues count like any worker's.
    both = load_layout(
        '{"workers": [{"name": "g", "queues": ["long", "encode", "decode"], "devices": [0, 1],'
        ' "lane": "interactive"}, {"name": "s", "queues": ["short", "medium", "long"]}]}',
        num_gpus=2,
    )
    assert both.workers[0].consumed_queues() == ("long@interactive", "encode", "decode")


def test_admission_counts_a_group_as_its_speedup_in_cards() -> None:
    layout = default_layout(num_gpus=8, group_cards=4)
    lane, limits = "long@interactive", AdmissionLimits()
    video = WorkItem(lane, 7, 1500.0)  # a 25-min single-card video waiting on the lane
    assert expected_wait(lane, 7, [video], layout) == pytest.approx(1500.0 / 3.52)
    # Lane work lands on the group only; plain long work on the 4 single cards only.
    assert expected_wait("long", 7, [video], layout) == 0.0
    assert expected_wait(lane, 7, [WorkItem("long", 7, 3000.0)], layout) == 0.0
    # Five videos ahead: 7,500 s ÷ 3.52 = 2,131 s > the 1,800-s limit; on one card it would be 7,500 s.
    five = [video] * 5
    refused = decide(lane, 7, five, layout, limits)
    assert not refused.accepted and refused.expected_wait_seconds == pytest.approx(7500 / 3.52)
    assert decide(lane, 7, [video] * 4, layout, limits).accepted  # 6,000 ÷ 3.52 = 1,705 s


def test_simulator_routes_the_interactive_lane_to_the_group() -> None:
    routed = group_layout([4, 1, 1, 1, 1], group_lane=INTERACTIVE)
    cfg = SimConfig(layout=routed, limits=None, checkpoint_seconds=0.0, steps={SEED_VIDEO_SECONDS: 50})
    fast = Request(0.0, VIDEO, SEED_VIDEO_SECONDS, INTERACTIVE)
    slow = Request(0.0, VIDEO, SEED_VIDEO_SECONDS)
    run = simulate([fast, slow], cfg)
    assert run.lanes[INTERACTIVE].latencies[0] == pytest.approx(SEED_VIDEO_SECONDS / 3.52)
    assert run.lanes[""].latencies[0] == pytest.approx(SEED_VIDEO_SECONDS)
    # The same arrivals whatever the interactive share; only the lanes differ.
    plain, mixed = video_workload(50), video_workload(50, interactive_share=0.4)
    assert [r.arrival for r in plain] == [r.arrival for r in mixed]
    assert 0 < sum(r.lane == INTERACTIVE for r in mixed) < 50


def test_routed_pooled_layout_serves_interactive_requests_faster() -> None:
    results = {r.layout: r for r in simulate_groups()}
    routed, pooled, singles = (
        results["pooled, routed: 1×4 interactive + 4×1"],
        results["pooled: 1×4 + 4×1"],
        results["8×1"],
    )
    # Routing is what makes the pooled layout pay: the interactive median falls from the
    # unrouted pool's (and 8 single cards') ~21-25 min to ~12 min; the others keep a card's latency.
    assert routed.interactive_p50_minutes < 0.6 * pooled.interactive_p50_minutes
    assert routed.interactive_p50_minutes < 0.5 * singles.interactive_p50_minutes
    assert routed.other_p50_minutes == pytest.approx(singles.other_p50_minutes, rel=0.05)
    assert routed.capacity_per_hour == pytest.approx(pooled.capacity_per_hour)
