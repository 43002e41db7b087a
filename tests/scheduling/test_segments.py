"""The segment plan of a long video: frames per segment (the last included), seeds, step numbering, cost."""

from __future__ import annotations

import pytest

from genserver.registry import load_registry
from genserver.scheduling.cost import JobShape, estimate_job_seconds
from genserver.scheduling.segments import (
    Segment,
    estimate_segmented_seconds,
    generated_frames,
    is_segmented,
    segment_count,
    segment_of_step,
    segment_plan,
    segment_seed,
)


def test_a_video_that_fits_is_one_segment_with_the_jobs_seed():
    assert segment_plan(81, 81, 4, seed=7) == [Segment(0, 81, 81, 7)]
    assert segment_plan(9, 0, 4, seed=7) == [Segment(0, 9, 9, 7)]  # a model without segments
    assert not is_segmented(81, 81) and is_segmented(85, 81) and not is_segmented(961, 0)


@pytest.mark.parametrize(
    "frames, expected",
    [
        (162, [(81, 81), (81, 81)]),
        (241, [(81, 81), (81, 81), (79, 81)]),  # 15 s: the last keeps 79 of the 81 it generates
        (85, [(81, 81), (4, 5)]),  # 4 left over: Wan generates 4k+1 = 5 frames and keeps 4
        (82, [(81, 81), (1, 1)]),
        (961, [(81, 81)] * 11 + [(70, 73)]),  # 60 s at 16 fps
    ],
)
def test_frames_per_segment_the_last_included(frames, expected):
    plan = segment_plan(frames, 81, 4, seed=1)
    assert [(s.frames, s.generate_frames) for s in plan] == expected
    assert sum(s.frames for s in plan) == frames and [s.index for s in plan] == list(range(len(plan)))
    assert all((s.generate_frames - 1) % 4 == 0 and s.generate_frames >= s.frames for s in plan)
    assert segment_count(frames, 81) == len(plan)


def test_tiny_wan_segments_keep_the_frames_rule():
    plan = segment_plan(25, 9, 4, seed=3)
    assert [(s.frames, s.generate_frames) for s in plan] == [(9, 9), (9, 9), (7, 9)]
    assert generated_frames(7, 4) == 9 and generated_frames(1, 4) == 1 and generated_frames(6, 1) == 6


def test_seeds_are_deterministic_distinct_and_in_range():
    plan = segment_plan(961, 81, 4, seed=1234)
    seeds = [s.seed for s in plan]
    assert seeds[0] == 1234  # segment 0 is what the unsegmented job would have made
    assert len(set(seeds)) == len(seeds)
    assert seeds == [s.seed for s in segment_plan(961, 81, 4, seed=1234)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert segment_seed(1235, 1) != segment_seed(1234, 1) and segment_seed(1234, 2) == seeds[2]


def test_global_steps_name_their_segment_unambiguously():
    assert segment_of_step(0, 50) == (0, 0)
    assert segment_of_step(49, 50) == (0, 49)
    assert segment_of_step(50, 50) == (1, 0)  # segment 0's end is segment 1's start
    assert segment_of_step(149, 50) == (2, 49)


def test_a_misaligned_segment_length_is_refused():
    with pytest.raises(ValueError):
        segment_plan(200, 80, 4)


def test_the_estimate_of_three_segments_is_three_times_one():
    spec = load_registry().get("wan-sim")
    one = JobShape("wan", 832, 480, 81, 50, 5.0)
    three = JobShape("wan", 832, 480, 243, 50, 5.0)
    single = estimate_segmented_seconds(one, segment_plan(81, 81, 4), spec.cost_points, 450.0)
    triple = estimate_segmented_seconds(three, segment_plan(243, 81, 4), spec.cost_points, 450.0)
    assert single == pytest.approx(estimate_job_seconds(one, spec.cost_points, 450.0))
    assert triple == pytest.approx(3 * single)
    # Not the cost of one 243-frame clip: attention's quadratic term makes that dearer.
    assert estimate_job_seconds(three, spec.cost_points, 450.0) > triple


def test_registry_segment_lengths():
    reg = load_registry()
    assert reg.get("wan-sim").segment_frames == 81 and reg.get("wan-sim").limits.max_frames >= 961
    tiny = reg.get("tiny-wan")
    assert (tiny.segment_frames - 1) % tiny.limits.frames_step == 0 and tiny.limits.max_frames > tiny.segment_frames
    assert reg.get("sdxl-sim").segment_frames == 0
