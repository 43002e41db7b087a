"""Card groups: the seed's one-request-per-group-of-cards trade-off, in the layout and the simulator."""
from __future__ import annotations

import pytest

from genserver.scheduling.pools import GROUP_EFFICIENCY, WorkerSpec, group_speedup
from genserver.scheduling.simulator import (
    SEED_VIDEO_SECONDS, VIDEO, Request, SimConfig, group_layout, group_layouts, group_table, simulate,
    simulate_groups,
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
    cfg = SimConfig(layout=group_layout([group]), limits=None, checkpoint_seconds=0.0,
                    steps={SEED_VIDEO_SECONDS: 50})
    return simulate([Request(0.0, VIDEO, SEED_VIDEO_SECONDS)], cfg).classes[VIDEO].latencies[0]


def test_group_of_4_finishes_a_lone_job_3_5x_faster() -> None:
    single, group = _lone_job_seconds(1), _lone_job_seconds(4)
    assert single == pytest.approx(SEED_VIDEO_SECONDS)
    assert single / group == pytest.approx(3.52)


def test_simulated_layouts() -> None:
    assert list(group_layouts(8)) == ["8×1", "4×2", "2×4", "1×8", "pooled: 1×4 + 4×1"]
    first = simulate_groups()
    results = {r.layout: r for r in first}
    assert results["8×1"].capacity_per_hour == pytest.approx(19.2)
    assert results["1×8"].load == pytest.approx(0.875)
    # larger groups: lower median latency; the whole machine as one group queues the most
    assert results["2×4"].p50_minutes < results["4×2"].p50_minutes < results["8×1"].p50_minutes
    assert results["1×8"].p99_minutes > results["2×4"].p99_minutes
    assert simulate_groups() == first  # deterministic
