"""The MP4 writer: the same frames give the same bytes, however used the worker's heap is (workers/runtime/video.py)."""

from __future__ import annotations

import pytest

from bench.mp4 import differing_encodes
from workers.runtime import video
from workers.runtime.wan import WanFamily

from .conftest import make_request, run_to_end

# /proc/cpuinfo's first CPU on an AVX-512 machine and on an AVX2-only one (flags cut to the ones that matter).
AVX512_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 ssse3 fma sse4_2 avx bmi1 avx2 bmi2 avx512f avx512bw\n\n"
AVX2_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 ssse3 fma sse4_2 avx bmi1 avx2 bmi2\n\n"


@pytest.fixture(scope="module")
def wan_frames(wan_family: WanFamily) -> list:
    """A tiny-wan clip (9 frames, 64×64): x264's AVX-512 code misread memory on such clips, not on noise."""
    request = make_request("tiny-wan", prompt="waves in segments", seed=5, steps=4)
    embeddings = wan_family.encode([(request.prompt, request.negative_prompt)])[0]
    state = wan_family.prepare(request, embeddings)
    run_to_end(wan_family, state)
    return wan_family.decode(state)[0]


def test_the_same_frames_encode_to_the_same_bytes_in_a_used_heap(wan_frames: list) -> None:
    # A long-lived decode worker's freed memory holds old data; x264 must not read any of it. Uncapped on an
    # AVX-512 CPU, 84-86 of 100 encodes of this clip differed (183 of 200 in bench.mp4, docs/BENCHMARKS.md). On a
    # CPU without AVX-512 this checks the same promise with nothing to cap.
    differing = differing_encodes(wan_frames, 100)
    assert differing == 0, f"{differing} of 100 encodes of the same frames gave other bytes"


def test_x264_is_capped_at_avx2_only_where_the_cpu_has_avx512() -> None:
    assert video.cpu_flags(AVX512_CPUINFO) >= {"avx2", "avx512f"}
    assert video.x264_params(video.cpu_flags(AVX512_CPUINFO)) == "asm=avx2"
    assert video.x264_params(video.cpu_flags(AVX2_CPUINFO)) == ""  # its own choice: AVX2 already
    assert video.x264_params(video.cpu_flags("")) == ""  # no flags line (not Linux, or an odd kernel)
