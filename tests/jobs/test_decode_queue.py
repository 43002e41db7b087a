"""The decode workers' queue as an ETA reads it (selectors/decode_queue.py): the queued decodes past every hop
counted per model give the same line as one row each (exactly with one worker, within a decode with more)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from genserver.jobs.selectors.decode_queue import DecodeQueue

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
DECODE = {"image": 0.4, "video": 6.0, "unlearned": 0.0}
HOP = {"image": 0.3, "video": 1.5, "unlearned": 0.0}


def _rows(rng: random.Random, n: int) -> list[tuple[str, bool, datetime | None, datetime | None]]:
    """n decodes: a few in service, the rest queued, published over the last minute (first published first)."""
    published = sorted(NOW - timedelta(seconds=rng.uniform(0, 60)) for _ in range(n))
    rows = []
    for i, at in enumerate(published):
        model = rng.choice(list(DECODE))
        serving = i < 2 and rng.random() < 0.7
        rows.append((model, serving, at + timedelta(seconds=0.1) if serving else None, at))
    return rows


def _split(rows, since):
    """What selectors.decode_queue.line reads: in service or published from `since` one row each, else per model."""
    near = [r for r in rows if r[1] or r[3] is None or r[3] >= since]
    settled: dict[str, int] = {}
    for model, serving, _, published in rows:
        if not serving and published is not None and published < since:
            settled[model] = settled.get(model, 0) + 1
    return near, list(settled.items())


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("servers", [1, 2, 3])
def test_the_settled_decodes_per_model_give_the_line_of_one_row_each(seed, servers):
    rng = random.Random(seed)
    rows = _rows(rng, rng.randint(0, 60))
    args = (servers, DECODE.__getitem__, NOW, HOP.__getitem__)
    exact = DecodeQueue.of(rows, *args)
    near, settled = _split(rows, NOW - timedelta(seconds=max(HOP.values())))
    assert sum(n for _, n in settled) + len(near) == len(rows)
    counted = DecodeQueue.of(near, *args, settled=settled)
    tolerance = 1e-9 if servers == 1 else max(DECODE.values())
    assert counted.free_in == pytest.approx(exact.free_in, abs=tolerance)
    for arrive_in in (0.0, 5.0, 50.0):
        earlier = [(rng.uniform(0, 20), 0.4) for _ in range(3)]
        assert counted.wait(arrive_in, earlier) == pytest.approx(exact.wait(arrive_in, earlier), abs=tolerance)


def test_settled_work_fills_the_freest_workers_to_one_level():
    queue = DecodeQueue.of(
        [("video", True, NOW - timedelta(seconds=1), NOW)],
        3,
        DECODE.__getitem__,
        NOW,
        HOP.__getitem__,
        settled=[("image", 5)],
    )
    # One worker has 5 s of the video left; 2 s of images fill the other two to 1 s each.
    assert queue.free_in == pytest.approx((1.0, 1.0, 5.0))
