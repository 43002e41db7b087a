"""Merged work in the runtime: several same-shape jobs stepped as one batch (Family.step_many).

Each job keeps its own seed, prompt, scheduler and generator, so its result is
the one it would get alone (up to float summation order in the batched call),
and a job that leaves the batch does not change the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from genserver.registry import load_registry
from genserver.storage import LocalStorage
from workers.runtime import blob, stages
from workers.runtime.base import DenoiseState, Family, GenerationRequest
from workers.runtime.simulated import SimulatedFamily

from .conftest import make_request, run_to_end

# Batched convolutions and matmuls sum in another order than single ones: results
# agree to float32 rounding, amplified a little by the steps.
LATENT_TOLERANCE = 1e-4

CASES = [
    ("tiny-sd", "euler"),
    ("tiny-sd", "euler_a"),
    ("tiny-sd", "dpmpp_2m"),
    ("tiny-sdxl", "euler"),
    ("tiny-flux", "flow_euler"),
    ("tiny-flux", "flow_dpmpp_2m"),
]


def members(model: str) -> list[GenerationRequest]:
    """Three jobs of one shape: different seeds, prompts and output counts."""
    return [
        make_request(model, job_id="a", seed=11, prompt="a red cat on a sofa"),
        make_request(model, job_id="b", seed=22, prompt="a lighthouse at dusk", num_outputs=2),
        make_request(model, job_id="c", seed=33, prompt="a red cat on a sofa", negative_prompt=""),
    ]


def prepared(family: Family, request: GenerationRequest) -> DenoiseState:
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    return family.prepare(request, embeddings)


def alone(family: Family, request: GenerationRequest) -> torch.Tensor:
    return run_to_end(family, prepared(family, request))


@pytest.mark.parametrize("model,scheduler", CASES)
def test_merged_jobs_match_each_job_alone(load_family: Callable[..., Family], model: str, scheduler: str) -> None:
    family = load_family(model, scheduler)
    requests = members(model)
    states = [prepared(family, r) for r in requests]
    while not states[0].done:
        family.step_many(states)
    for request, state in zip(requests, states):
        assert state.step == request.steps
        expected = alone(family, request)
        assert state.latents.shape == expected.shape
        assert torch.allclose(state.latents, expected, atol=LATENT_TOLERANCE, rtol=0), (
            request.job_id,
            (state.latents - expected).abs().max(),
        )
    # Different seeds and prompts stayed different.
    assert not torch.allclose(states[0].latents, states[2].latents[:1], atol=1e-2)


def test_merged_wan_jobs_match_each_job_alone(wan_family: Family) -> None:

    requests = [
        make_request("tiny-wan", job_id="a", seed=1),
        make_request("tiny-wan", job_id="b", seed=2, prompt="a boat on a lake"),
    ]
    states = [prepared(wan_family, r) for r in requests]
    while not states[0].done:
        wan_family.step_many(states)
    for request, state in zip(requests, states):
        expected = alone(wan_family, request)
        assert torch.allclose(state.latents, expected, atol=LATENT_TOLERANCE, rtol=0), request.job_id


def test_merged_images_decode_like_lone_ones(load_family: Callable[..., Family]) -> None:
    family = load_family("tiny-sd")
    requests = members("tiny-sd")[:2]
    states = [prepared(family, r) for r in requests]
    while not states[0].done:
        family.step_many(states)
    for request, state in zip(requests, states):
        lone = prepared(family, request)
        run_to_end(family, lone)
        for merged_image, lone_image in zip(family.decode(state), family.decode(lone)):
            diff = (torch.tensor(list(merged_image.getdata())) - torch.tensor(list(lone_image.getdata()))).abs()
            assert int(diff.max()) <= 1, request.job_id  # at most one level of 255 off, from rounding


def test_a_member_leaving_midway_does_not_change_the_others(load_family: Callable[..., Family], tmp_path: Path) -> None:
    family = load_family("tiny-sd", "dpmpp_2m")
    requests = members("tiny-sd")
    states = [prepared(family, r) for r in requests]
    storage = LocalStorage(tmp_path)
    asked: list[tuple[str, int]] = []

    def should_stop(state: DenoiseState, step: int) -> str:
        asked.append((state.request.job_id, step))
        return "cancelled" if state.request.job_id == "b" and step == 2 else ""

    results = stages.run_merged_chunk(
        family,
        storage,
        states,
        until_step=requests[0].steps,
        preview_every=2,
        should_stop=should_stop,
        on_preview=lambda *_: None,
    )
    assert [r.stopped for r in results] == ["", "cancelled", ""]
    assert results[1].step == 2 and results[1].checkpoint_key == ""
    assert not storage.exists(stages.checkpoint_key("b", 2)) and not storage.exists(stages.checkpoint_key("b", 6))
    assert ("b", 3) not in asked  # asked before every step until it left, never after
    for i in (0, 2):
        assert results[i].step == requests[i].steps and storage.exists(results[i].checkpoint_key)
        assert results[i].step_seconds is None  # a merged step is not one job's step time
        assert torch.allclose(states[i].latents, alone(family, requests[i]), atol=LATENT_TOLERANCE, rtol=0)
        assert storage.exists(f"previews/{requests[i].job_id}/preview.png")


def test_each_member_checkpoint_resumes_alone(load_family: Callable[..., Family], tmp_path: Path) -> None:
    """A merged chunk's checkpoints are per job: one restored alone finishes as if never merged."""
    family = load_family("tiny-sd", "dpmpp_2m")
    requests = members("tiny-sd")[:2]
    states = [prepared(family, r) for r in requests]
    storage = LocalStorage(tmp_path)
    results = stages.run_merged_chunk(
        family, storage, states, until_step=3, preview_every=0, should_stop=lambda *_: "", on_preview=lambda *_: None
    )
    for request, result in zip(requests, results):
        embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
        resumed = family.restore(request, embeddings, blob.loads(storage.get(result.checkpoint_key)))
        assert resumed.step == 3
        assert torch.allclose(run_to_end(family, resumed), alone(family, request), atol=LATENT_TOLERANCE, rtol=0)


def test_a_chunk_cut_short_ends_the_whole_batch_at_that_step_with_checkpoints(
    load_family: Callable[..., Family], tmp_path: Path
) -> None:
    """`cut_short` (a job published ahead waits for this card) is asked after the chunk's first step, before
    each further one; True ends the chunk there for every member, saved as a planned chunk end is."""
    family = load_family("tiny-sd", "dpmpp_2m")
    requests = members("tiny-sd")[:2]
    states = [prepared(family, r) for r in requests]
    storage = LocalStorage(tmp_path)
    asked: list[int] = []

    def cut_short() -> bool:
        asked.append(states[0].step)
        return states[0].step == 2

    results = stages.run_merged_chunk(
        family,
        storage,
        states,
        until_step=requests[0].steps,
        preview_every=0,
        should_stop=lambda *_: "",
        on_preview=lambda *_: None,
        cut_short=cut_short,
    )
    assert asked == [1, 2]  # never before the first step: a cut chunk still moves its jobs on
    assert [(r.step, r.stopped) for r in results] == [(2, ""), (2, "")]
    for request, result in zip(requests, results):
        assert result.checkpoint_key == stages.checkpoint_key(request.job_id, 2)
        assert storage.exists(result.checkpoint_key)
        embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
        resumed = family.restore(request, embeddings, blob.loads(storage.get(result.checkpoint_key)))
        assert torch.allclose(run_to_end(family, resumed), alone(family, request), atol=LATENT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("change", [{"steps": 7}, {"width": 128}, {"guidance_scale": 3.0}])
def test_jobs_of_another_shape_are_refused(load_family: Callable[..., Family], change: dict[str, Any]) -> None:
    family = load_family("tiny-sd")
    a = prepared(family, make_request("tiny-sd", job_id="a"))
    b = prepared(family, make_request("tiny-sd", job_id="b", **change))
    with pytest.raises(ValueError, match="cannot share a batch"):
        family.step_many([a, b])


def test_jobs_at_another_step_are_refused(load_family: Callable[..., Family]) -> None:
    family = load_family("tiny-sd")
    a, b = (prepared(family, make_request("tiny-sd", job_id=j)) for j in "ab")
    family.step(a)
    with pytest.raises(ValueError, match="at step 1"):
        family.step_many([b, a])


def test_simulated_merged_step_takes_the_batch_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated backend sleeps once per merged step, for the cost model's merged time: its arithmetic is part
    of that time (here a clock that only sleeps move: the step's sleep is the whole of it)."""
    spec = load_registry().get("sdxl-turbo-sim")
    family = SimulatedFamily(spec, "cpu", tmp_path)
    slept: list[float] = []
    monkeypatch.setattr("workers.runtime.simulated.time.sleep", slept.append)
    monkeypatch.setattr("workers.runtime.simulated.time.perf_counter", lambda: sum(slept))
    requests = [
        make_request("sdxl-turbo-sim", job_id=str(i), seed=i, width=512, height=512, steps=4, guidance_scale=0.0)
        for i in range(4)
    ]
    states = [family.prepare(r, family.encode([(r.prompt, "")])[0]) for r in requests]
    family.step_many(states)
    assert len(slept) == 1
    one = family.step_seconds(requests[0])
    assert one < slept[0] < 4 * one  # four images in less than four images' time: the card was idle
    big = SimulatedFamily(load_registry().get("sdxl-sim"), "cpu", tmp_path)
    requests = [dataclasses.replace(r, model="sdxl-sim", width=1024, height=1024) for r in requests]
    states = [big.prepare(r, big.encode([(r.prompt, "")])[0]) for r in requests]
    big.step_many(states)
    assert slept[-1] == pytest.approx(4 * big.step_seconds(requests[0]))  # compute-bound: no saving


def test_a_simulated_steps_arithmetic_is_inside_its_modelled_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The arithmetic stands in for the card's work: a step that took `spent` seconds of it sleeps what is left of its
    modelled time, and nothing where the arithmetic took longer."""
    family = SimulatedFamily(load_registry().get("sdxl-sim"), "cpu", tmp_path, time_scale=0.5)
    request = make_request("sdxl-sim", width=512, height=512, steps=4)
    modelled = family.step_seconds(request) * 0.5
    for spent, left in ((0.25 * modelled, 0.75 * modelled), (2 * modelled, 0.0)):
        readings = iter([100.0, 100.0 + spent])  # when the step began, and when its arithmetic was done
        slept: list[float] = []
        monkeypatch.setattr("workers.runtime.simulated.time.perf_counter", readings.__next__)
        monkeypatch.setattr("workers.runtime.simulated.time.sleep", slept.append)
        state = family.prepare(request, family.encode([(request.prompt, "")])[0])
        family.step(state)
        assert state.step == 1 and slept == [pytest.approx(left)]


def test_a_merged_chunks_time_is_shared_by_the_members_rows(tmp_path: Path) -> None:
    """Quotas count a job's card time: a merged batch's seconds go to its members by their outputs (rows);
    a lone job's step time (which teaches the cost model) stays unreported for a merged one."""
    family = SimulatedFamily(load_registry().get("sdxl-turbo-sim"), "cpu", tmp_path)
    requests = [
        make_request(
            "sdxl-turbo-sim", job_id=j, seed=i, width=512, height=512, steps=4, guidance_scale=0.0, num_outputs=n
        )
        for i, (j, n) in enumerate((("a", 1), ("b", 2)))
    ]
    states = [family.prepare(r, family.encode([(r.prompt, "")])[0]) for r in requests]
    results = stages.run_merged_chunk(
        family,
        LocalStorage(tmp_path),
        states,
        until_step=2,
        preview_every=0,
        should_stop=lambda *_: "",
        on_preview=lambda *_: None,
    )
    assert results[0].seconds > 0 and results[1].seconds == pytest.approx(2 * results[0].seconds)
    assert results[0].step_seconds is None and results[1].step_seconds is None
    lone = stages.run_chunk(
        family,
        LocalStorage(tmp_path),
        family.prepare(requests[0], family.encode([(requests[0].prompt, "")])[0]),
        until_step=2,
        preview_every=0,
        should_stop=lambda _: "",
        on_preview=lambda *_: None,
    )
    assert lone.seconds == pytest.approx(lone.step_seconds * 2)
