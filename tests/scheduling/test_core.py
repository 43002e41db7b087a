"""Unit tests of the scheduling core: plain Python, no Django, no broker.

Run alone with `.venv/bin/python -m pytest tests/scheduling -q -p no:django`.
"""

from __future__ import annotations

import json
import math

import pytest

from genserver.registry import load_registry
from genserver.scheduling.admission import AdmissionLimits, WorkItem, decide, expected_start, expected_wait, work_ahead
from genserver.scheduling.chunking import chunk_plan, steps_per_chunk
from genserver.scheduling.classes import (
    DEFAULT_PRIORITY,
    LONG,
    MEDIUM,
    PRIORITY_STEPS,
    SHORT,
    ClassThresholds,
    band_of,
    priority_for,
)
from genserver.scheduling.cost import JobShape, est_seconds, estimate_job_seconds, interpolate_factor
from genserver.scheduling.pools import PoolLayout, WorkerSpec, default_layout, load_layout, parse_layout

# The seed chapter's cost table: (name, tokens, steps, cfg passes, TFLOP per 1k tokens) → seconds on an H100.
SEED_REQS = [
    ("SDXL 512² · 20 steps", 1024, 20, 2, 2.0, 0.2),
    ("SDXL 1024² · 30 steps", 4096, 30, 2, 2.9, 1.6),
    ("FLUX 1024² · 28 steps", 4608, 28, 1, 19.5, 5.6),
    ("FLUX 2048² · 28 steps", 16896, 28, 1, 24.7, 26.0),
    ("Wan 5 s 480p · 50 steps", 33272, 50, 2, 90.0, 665.4),
    ("Wan 5 s 720p · 50 steps", 76112, 50, 2, 175.0, 2959.9),
]
# The same requests through the registry: (model, width, height, frames, steps, guidance).
REGISTRY_REQS = [
    ("sdxl-sim", 512, 512, 1, 20, 5.0),
    ("sdxl-sim", 1024, 1024, 1, 30, 5.0),
    ("flux-sim", 1024, 1024, 1, 28, 3.5),
    ("flux-sim", 2048, 2048, 1, 28, 3.5),
    ("wan-sim", 832, 480, 81, 50, 5.0),
    ("wan-sim", 1280, 720, 81, 50, 5.0),
]


# --------------------------------------------------------------------------- cost model


@pytest.mark.parametrize("name, tokens, steps, cfg, factor, expected", SEED_REQS)
def test_seed_cost_table_with_the_seeds_factors(name, tokens, steps, cfg, factor, expected):
    assert f"{est_seconds(tokens, steps, cfg, factor):.1f}" == f"{expected:.1f}", name


@pytest.mark.parametrize("request_, seed_row", list(zip(REGISTRY_REQS, SEED_REQS)))
def test_seed_cost_table_through_the_registry(request_, seed_row):
    model, width, height, frames, steps, guidance = request_
    spec = load_registry().get(model)
    shape = JobShape(
        family=spec.family, width=width, height=height, num_frames=frames, steps=steps, guidance_scale=guidance
    )
    name, tokens, _, cfg, _, expected = seed_row
    assert shape.tokens() == tokens, name
    assert shape.cfg_passes() == cfg, name
    assert f"{estimate_job_seconds(shape, spec.cost_points):.1f}" == f"{expected:.1f}", name


def test_cost_grows_with_outputs_and_correction():
    spec = load_registry().get("sdxl-sim")
    one = JobShape("unet", 1024, 1024, 1, 30, 5.0)
    four = JobShape("unet", 1024, 1024, 1, 30, 5.0, num_outputs=4)
    assert estimate_job_seconds(four, spec.cost_points) == pytest.approx(
        4 * estimate_job_seconds(one, spec.cost_points)
    )
    assert estimate_job_seconds(one, spec.cost_points, correction=1.5) == pytest.approx(
        1.5 * estimate_job_seconds(one, spec.cost_points)
    )


def test_interpolate_factor_between_and_beyond_the_points():
    points = {1000: 2.0, 3000: 4.0}
    assert interpolate_factor(points, 2000) == pytest.approx(3.0)
    assert interpolate_factor(points, 5000) == pytest.approx(6.0)  # the last segment, extended
    assert interpolate_factor({1000: 2.0}, 50_000) == 2.0
    assert interpolate_factor(points, -(10**9)) == pytest.approx(0.02)  # floored at 1 % of the smallest
    with pytest.raises(ValueError):
        interpolate_factor({}, 1000)


# --------------------------------------------------------------------------- classes and priorities


def test_classes_by_expected_seconds():
    t = ClassThresholds()
    assert [t.classify(s) for s in (0.2, 14.9, 15.0, 119.9, 120.0, 2959.9)] == [
        SHORT,
        SHORT,
        MEDIUM,
        MEDIUM,
        LONG,
        LONG,
    ]
    with pytest.raises(ValueError):
        ClassThresholds(short=120, medium=15)


def test_priority_bands_order_the_classes():
    t = ClassThresholds()
    short = [priority_for(SHORT, s, started, t) for s in (0.1, 1.0, 5.0, 14.9) for started in (False, True)]
    medium_cont, medium_new = priority_for(MEDIUM, 60, True, t), priority_for(MEDIUM, 60, False, t)
    long_cont = priority_for(LONG, 3000, True, t)
    long_new = [priority_for(LONG, s, False, t) for s in (120, 665.4, 2959.9, 10**6)]
    assert max(short) < medium_cont < medium_new < long_cont < min(long_new)
    assert all(p in PRIORITY_STEPS for p in (*short, medium_cont, medium_new, long_cont, *long_new))
    assert max(*short, medium_new, *long_new) < DEFAULT_PRIORITY  # unprioritised messages never jump ahead
    assert [band_of(p) for p in (min(short), max(short), medium_cont, medium_new, long_cont, max(long_new))] == [
        SHORT,
        SHORT,
        MEDIUM,
        MEDIUM,
        LONG,
        LONG,
    ]


def test_shortest_first_within_short_and_within_new_long():
    t = ClassThresholds()
    short = [priority_for(SHORT, s, False, t) for s in (0.2, 1.0, 3.0, 6.0, 14.9)]
    assert short == sorted(short) and short[0] < short[-1]
    assert priority_for(SHORT, 0.2, False, t) == 0  # sub-second drafts first
    assert priority_for(LONG, 120, False, t) < priority_for(LONG, 2959.9, False, t)
    with pytest.raises(ValueError):
        priority_for("huge", 1.0, False, t)


# --------------------------------------------------------------------------- chunking


def test_steps_per_chunk_never_below_one_step():
    assert steps_per_chunk(4.0, 2.4) == 1
    assert steps_per_chunk(4.8, 2.4) == 2  # no float truncation to 1
    assert steps_per_chunk(2.4, 6.0) == 1
    assert steps_per_chunk(4.0, 0.1) == 40
    assert chunk_plan(30, 4.0, 0.2) == [20, 10]
    assert chunk_plan(50, 4.0, 6.0) == [1] * 50
    with pytest.raises(ValueError):
        steps_per_chunk(4.0, 0.0)


# --------------------------------------------------------------------------- admission


def test_admission_refuses_long_before_short_under_load():
    layout, limits = default_layout(4), AdmissionLimits()
    t = ClassThresholds()
    long_new, long_cont = priority_for(LONG, 300, False, t), priority_for(LONG, 300, True, t)
    short = priority_for(SHORT, 3.0, False, t)
    items = [WorkItem(LONG, long_cont, 250.0, running=True, chunk_remaining_seconds=3.0) for _ in range(3)]
    items += [WorkItem(LONG, long_new, 300.0) for _ in range(25)]  # 7,500 s of queued video
    items += [WorkItem(SHORT, short, 3.0) for _ in range(5)]
    long_decision = decide(LONG, long_new, items, layout, limits)
    short_decision = decide(SHORT, short, items, layout, limits)
    assert not long_decision.accepted
    assert long_decision.retry_after_seconds >= 1 and "long" in long_decision.reason
    assert short_decision.accepted
    assert short_decision.expected_wait_seconds < 60  # only short work and chunk tails are ahead of it


def test_admission_accepts_everything_when_idle():
    for cls in (SHORT, MEDIUM, LONG):
        d = decide(cls, 5, [], default_layout(4), AdmissionLimits())
        assert d.accepted and d.expected_wait_seconds == 0


def test_work_ahead_counts_running_chunks_of_worse_priority():
    layout = default_layout(4)
    items = [WorkItem(LONG, 6, 1000.0, running=True, chunk_remaining_seconds=4.0)]
    ahead, cards = work_ahead(SHORT, 2, items, layout)
    assert cards == 4 and ahead == pytest.approx(4.0)  # only the rest of its chunk, not the whole video
    assert expected_wait(SHORT, 2, items, layout) == 0.0  # three cards are idle: one takes it at once
    every_card = items * 4
    assert expected_wait(SHORT, 2, every_card, layout) == pytest.approx(4.0)  # the four chunks' rest, on 4 cards


def test_an_idle_card_starts_a_job_at_once_unless_work_at_its_priority_waits():
    layout = default_layout(4)
    running = [WorkItem(SHORT, 1, 3.0, running=True, chunk_remaining_seconds=3.0)] * 3
    assert expected_wait(SHORT, 2, running, layout) == 0.0  # one card of four is idle
    waiting = running + [WorkItem(SHORT, 2, 6.0)]  # a job at its priority waits first: it takes the idle card
    assert expected_wait(SHORT, 2, waiting, layout) == pytest.approx((9.0 + 6.0) / 4)
    worse = running + [WorkItem(SHORT, 3, 6.0)]  # a worse job waiting is not ahead of it
    assert expected_wait(SHORT, 2, worse, layout) == 0.0


def test_admission_on_a_one_card_layout_and_unknown_classes():
    layout = PoolLayout((WorkerSpec("gpu0", ("short", "medium", "long")), WorkerSpec("enc", ("encode", "decode"))))
    assert decide(LONG, 7, [], layout, AdmissionLimits()).accepted
    busy = [WorkItem(LONG, 7, 2000.0)]
    assert not decide(LONG, 7, busy, layout, AdmissionLimits()).accepted  # 2,000 s ahead on one card
    assert decide(SHORT, 2, busy, layout, AdmissionLimits()).accepted  # a queued video is not ahead of it
    assert math.isinf(expected_wait("nobody-serves-this", 7, [], layout))
    with pytest.raises(ValueError):
        decide("huge", 7, [], layout, AdmissionLimits())


# --------------------------------------------------------------------------- pool layouts


def test_default_layout_for_four_cards():
    # Every card takes every class (the simulator's measured policy); images go first by priority.
    layout = default_layout(4)
    denoise = [w for w in layout.workers if w.denoises]
    assert [w.queues for w in denoise] == [("short", "medium", "long")] * 4
    assert [w.devices for w in denoise] == [(0,), (1,), (2,), (3,)]
    assert (layout.capacity(SHORT), layout.capacity(MEDIUM), layout.capacity(LONG)) == (4, 4, 4)
    assert layout.queues_of("encode") == ("encode", "control", "webhooks") and layout.capacity("decode") == 1


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("image_cards", [None, 0, 1])
def test_default_layout_scales(gpus, image_cards):
    if image_cards == 1 and gpus == 1:
        with pytest.raises(ValueError, match="image_cards must be within 0..0"):
            default_layout(gpus, image_cards=image_cards)  # the one card must take long work
        return
    layout = default_layout(gpus, image_cards=image_cards)
    denoise = [w for w in layout.workers if w.denoises]
    assert len(denoise) == gpus
    assert [w.name for w in denoise if LONG not in w.queues] == (["gpu0"] if image_cards else [])
    assert layout.capacity(LONG) == gpus - (image_cards or 0)
    assert layout.capacity(SHORT) == gpus


def test_a_cap_on_long_cards_keeps_the_others_on_images():
    layout = default_layout(4, max_long_cards=2)
    assert [LONG in w.queues for w in layout.workers if w.denoises] == [False, False, True, True]
    with pytest.raises(ValueError, match="at least 1"):
        default_layout(4, max_long_cards=0)


def test_cpu_layout_and_overrides():
    cpu = default_layout(0, cpu_workers=2)
    assert all(w.devices == () for w in cpu.workers)
    spec = {
        "workers": [
            {"name": "a", "queues": ["short", "medium", "long"], "devices": [0]},
            {"name": "b", "queues": ["encode", "decode", "control"]},
        ]
    }
    layout = load_layout(json.dumps(spec), num_gpus=4)
    assert layout.capacity(LONG) == 1 and layout.to_dict()["workers"][0]["devices"] == [0]
    assert parse_layout(layout.to_dict()) == layout


def test_invalid_layouts_are_refused():
    with pytest.raises(ValueError, match="unknown queues"):
        WorkerSpec("x", ("gpu",))
    with pytest.raises(ValueError, match="without a worker"):
        PoolLayout((WorkerSpec("x", ("short",)),))
    with pytest.raises(ValueError, match="unique"):
        PoolLayout((WorkerSpec("x", ("short", "medium", "long", "encode", "decode")),) * 2)
    with pytest.raises(ValueError):
        parse_layout({"workers": [{"queues": ["short"]}]})


def test_an_eta_starts_a_job_once_the_whole_jobs_ahead_have_started():
    """bench.replay's case: three video cards, two running videos about to end and one 120 s video later, two
    300 s videos waiting. The first two cards to free take the two waiting videos; the new one takes the third."""
    layout = default_layout(4, image_cards=1)  # one image-only card, three that also run video
    running = [
        WorkItem(LONG, 6, 1.0, running=True, chunk_remaining_seconds=1.0),
        WorkItem(LONG, 6, 2.1, running=True, chunk_remaining_seconds=2.1),
        WorkItem(LONG, 6, 3.1, running=True, chunk_remaining_seconds=3.1),
    ]
    waiting = [WorkItem(LONG, 7, 15.0), WorkItem(LONG, 7, 15.0)]
    assert expected_start(LONG, 7, running + waiting, layout) == pytest.approx(3.1)
    assert expected_start(LONG, 7, iter(running + waiting), layout) == pytest.approx(3.1)  # read twice: any iterable
    # The fluid level (admission's) spreads the 30 s over the three cards: 12.07 s, later than the start.
    assert expected_wait(LONG, 7, running + waiting, layout) == pytest.approx((1.0 + 2.1 + 3.1 + 30.0) / 3)
    # A group of the live service's tally (two jobs summed in one item) is the same two jobs.
    grouped = [WorkItem(LONG, 7, 30.0, count=2)]
    assert expected_start(LONG, 7, running + grouped, layout) == pytest.approx(3.1)
    # A third waiting video goes on the card the first one left: 1.0 + 15.
    assert expected_start(LONG, 7, running + waiting + [WorkItem(LONG, 7, 15.0)], layout) == pytest.approx(16.0)
    # Worse jobs waiting are not ahead; better ones are, in priority order; an idle card starts it at once.
    assert expected_start(LONG, 6, running + [WorkItem(LONG, 7, 15.0)], layout) == pytest.approx(1.0)
    assert expected_start(LONG, 7, running[:2], layout) == 0.0


def test_an_eta_spreads_work_that_only_partly_lands_on_its_cards_and_falls_back_to_the_fluid_level():
    layout = default_layout(4, image_cards=1)
    # Images (served by all four cards, three of them the video cards) fill the video cards as a fluid: 4 s of
    # image work, three quarters of it on the three idle video cards, puts each at 1 s.
    images = [WorkItem(SHORT, 1, 4.0)]
    assert expected_start(LONG, 7, images, layout) == pytest.approx(1.0)
    assert expected_start(LONG, 7, images, layout) == pytest.approx(expected_wait(LONG, 7, images, layout))
    # More whole jobs ahead than it places one by one: the fluid level.
    many = [WorkItem(LONG, 7, 1.0, count=300)]
    assert expected_start(LONG, 7, many, layout) == pytest.approx(expected_wait(LONG, 7, many, layout))
    assert math.isinf(expected_start("nobody-serves-this", 7, [], layout))
