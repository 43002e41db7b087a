"""The overload cap's rule (scheduling/overload.py), shared by the simulator and the live service."""

from __future__ import annotations

import pytest

from genserver.scheduling.overload import LongCapPolicy, capped_layout, long_cards
from genserver.scheduling.pools import PoolLayout, WorkerSpec


def cards(*queues: tuple[str, ...]) -> PoolLayout:
    workers = [WorkerSpec(name=f"gpu{i}", devices=(i,), queues=q) for i, q in enumerate(queues)]
    workers += [WorkerSpec(name="encode", queues=("encode", "control")), WorkerSpec(name="decode", queues=("decode",))]
    return PoolLayout(tuple(workers))


def test_it_engages_above_the_engage_share_and_lets_go_below_the_release_share():
    policy = LongCapPolicy(engage_share=0.5, release_share=0.4)
    assert not policy.engaged(False, 800.0, 1800.0)
    assert policy.engaged(False, 901.0, 1800.0)
    assert policy.engaged(True, 800.0, 1800.0)  # between the two: it stays as it was
    assert not policy.engaged(False, 800.0, 1800.0)
    assert not policy.engaged(True, 700.0, 1800.0)
    assert [policy.cap(n) for n in (1, 2, 4)] == [1, 1, 3]
    with pytest.raises(ValueError):
        LongCapPolicy(engage_share=0.4, release_share=0.5)


def test_the_capped_layout_takes_long_off_the_cards_beyond_the_cap():
    layout = cards(("short", "medium"), ("short", "medium", "long"), ("short", "medium", "long"), ("long",))
    assert long_cards(layout) == 3
    capped = capped_layout(layout, 1)
    assert long_cards(capped) == 1
    # Cards with other work give long up first and keep the rest; the one that reads long alone keeps it.
    assert [w.queues for w in capped.workers if w.denoises] == [
        ("short", "medium"),
        ("short", "medium"),
        ("short", "medium"),
        ("long",),
    ]
    only_long = cards(("long",), ("long",), ("short", "medium"))
    assert [w.name for w in capped_layout(only_long, 1).workers if w.denoises] == ["gpu1", "gpu2"]
    assert capped_layout(layout, 3) == layout
