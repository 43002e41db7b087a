"""Changing the step count midway, per family: reschedule, stop early (decode the x0 estimate), extend.

See workers/runtime/reschedule.py for the continuation: the state after k steps is
re-expressed at the new schedule's noise level for step k from its x0 and noise
estimates, and a multistep solver restarts at first order.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from genserver.registry import load_registry
from genserver.storage import LocalStorage
from tests.runtime.conftest import make_request, resume_in_child, run_to_end
from workers.runtime import blob, stages
from workers.runtime.base import DenoiseState, Family, GenerationRequest
from workers.runtime.simulated import SimulatedFamily

# (model, scheduler, whether rescheduling to the same total is the identity: Euler-type, no history)
CASES = [
    ("tiny-sd", "euler", True),
    ("tiny-sd", "euler_a", True),
    ("tiny-sd", "dpmpp_2m", False),
    ("tiny-flux", "flow_euler", True),
    ("tiny-flux", "flow_dpmpp_2m", False),
    ("tiny-wan", "flow_euler", True),
    ("tiny-wan", "unipc", False),
    ("tiny-wan", "dpmpp_2m", False),
]
IDS = [f"{m}/{s}" for m, s, _ in CASES]


@pytest.fixture(scope="module")
def get_family(load_family: Callable[..., Family], wan_spec, wan_data_dir: Path) -> Callable[[str, str], Family]:
    from workers.runtime.wan import WanFamily

    wan: dict[str, Family] = {}

    def get(model: str, scheduler: str) -> Family:
        if model != "tiny-wan":
            return load_family(model, scheduler)
        if scheduler not in wan:
            wan[scheduler] = WanFamily(dataclasses.replace(wan_spec, scheduler=scheduler), "cpu", wan_data_dir)
        return wan[scheduler]

    return get


def request_for(model: str, **overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = dict(steps=6)
    if model == "tiny-flux":
        fields.update(negative_prompt="", guidance_scale=3.5)
    if model == "tiny-wan":
        fields.update(num_frames=5, job_id="job-v")
    return make_request(model, **(fields | overrides))


def started(family: Family, request: GenerationRequest, k: int) -> DenoiseState:
    state = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
    for _ in range(k):
        family.step(state)
    return state


def through_bytes(family: Family, state: DenoiseState) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(family.checkpoint(state), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def pixels(outputs: list[Any]) -> np.ndarray:
    first = outputs[0]
    return np.stack([np.asarray(f) for f in first]) if isinstance(first, list) else np.asarray(first)


@pytest.mark.parametrize("model,scheduler,identity", CASES, ids=IDS)
def test_rescheduling_to_the_same_total(get_family, model: str, scheduler: str, identity: bool) -> None:
    """Euler-type: the identity (same sigmas, x = x̂0 + σ·ε̂ back again). Multistep: a first-order restart,
    close to the plain run but not equal."""
    family = get_family(model, scheduler)
    request = request_for(model)
    plain = run_to_end(family, started(family, request, 0))
    state = started(family, request, 3)
    again = family.reschedule(state, request.steps)
    assert again.step == 3 and again.request.steps == request.steps
    assert torch.allclose(again.latents, state.latents, atol=1e-5, rtol=1e-5)
    continued = run_to_end(family, again)
    assert torch.isfinite(continued).all()
    if identity:
        assert torch.allclose(continued, plain, atol=1e-4, rtol=1e-4)
    else:
        assert (continued - plain).abs().max() < plain.abs().max()  # the same picture, roughly


@pytest.mark.parametrize("model,scheduler,identity", CASES, ids=IDS)
def test_extending_continues_to_the_new_total(get_family, model: str, scheduler: str, identity: bool) -> None:
    family = get_family(model, scheduler)
    request = request_for(model)
    plain = run_to_end(family, started(family, request, 0))
    state = family.reschedule(started(family, request, 3), 10)
    # More noise at step 3 of 10 than at step 3 of 6: refinement goes back up the schedule.
    assert state.step == 3 and state.request.steps == 10
    extended = run_to_end(family, state)
    assert state.step == 10 and torch.isfinite(extended).all()
    assert not torch.allclose(extended, plain, atol=1e-3)
    # Shortening without stopping: 2 done, 4 in all.
    shortened = family.reschedule(started(family, request, 2), 4)
    assert torch.isfinite(run_to_end(family, shortened)).all() and shortened.step == 4


@pytest.mark.parametrize("model,scheduler,identity", CASES, ids=IDS)
def test_extending_a_finished_schedule_is_deterministic(get_family, model: str, scheduler: str, identity: bool) -> None:
    """σ = 0 after the last step: the noise to add back comes from the job's own generator."""
    family = get_family(model, scheduler)
    request = request_for(model, steps=3)
    results = []
    for _ in range(2):
        state = family.reschedule(started(family, request, 3), 5)
        results.append(run_to_end(family, state))
    assert torch.isfinite(results[0]).all() and torch.equal(results[0], results[1])


def saved(family, state, tmp_path: Path) -> tuple[LocalStorage, str, str]:
    """The state's embeddings and checkpoint in storage, as a worker leaves them: (storage, embeddings, checkpoint)."""
    storage = LocalStorage(tmp_path)
    embeddings_key = storage.put("embeddings/e.pt", blob.dumps(state.embeddings))
    return storage, embeddings_key, stages.save_checkpoint(family, storage, state)


@pytest.mark.parametrize("model,scheduler,identity", CASES, ids=IDS)
def test_stop_early_decodes_the_saved_x0_estimate(
    get_family, model: str, scheduler: str, identity: bool, tmp_path: Path
) -> None:
    family = get_family(model, scheduler)
    request = request_for(model)
    state = started(family, request, 2)
    storage, embeddings_key, key = saved(family, state, tmp_path)
    data = blob.loads(storage.get(key))
    assert torch.equal(data["denoised"], state.extra["denoised"].cpu())
    # The job's record now says 2 steps: decode restores the 6-step state and decodes its x0 estimate.
    stopped = dataclasses.replace(request, steps=2)
    outputs = stages.decode(family, storage, stopped, checkpoint_ref=key)
    assert len(outputs) == (2 if model == "tiny-wan" else 1)
    decoded = pixels(family.decode(stages.load_state(family, storage, stopped, embeddings_key, key)))
    finished = dataclasses.replace(state, request=stopped, latents=data["denoised"], extra={})
    assert finished.done
    assert np.array_equal(decoded, pixels(family.decode(finished)))
    noisy = dataclasses.replace(state, request=stopped, extra={})
    assert not np.array_equal(decoded, pixels(family.decode(noisy)))  # not the noisy latents


@pytest.mark.parametrize(
    "model,scheduler", [("tiny-sd", "euler"), ("tiny-flux", "flow_dpmpp_2m"), ("tiny-wan", "unipc")]
)
def test_load_state_reschedules_a_checkpoint_made_for_another_total(
    get_family, model: str, scheduler: str, tmp_path: Path
) -> None:
    family = get_family(model, scheduler)
    request = request_for(model)
    state = started(family, request, 3)
    storage, embeddings_key, key = saved(family, state, tmp_path)
    with pytest.raises(ValueError, match="made for 6 steps"):
        family.restore(dataclasses.replace(request, steps=9), state.embeddings, blob.loads(storage.get(key)))
    loaded = stages.load_state(family, storage, dataclasses.replace(request, steps=9), embeddings_key, key)
    direct = family.reschedule(state, 9)
    assert loaded.step == 3 and loaded.request.steps == 9
    assert torch.allclose(run_to_end(family, loaded), run_to_end(family, direct), atol=1e-6, rtol=0)


@pytest.mark.parametrize("model,scheduler", [("tiny-sd", "dpmpp_2m"), ("tiny-wan", "unipc")])
def test_checkpoints_without_the_x0_estimate_still_restore(get_family, model: str, scheduler: str) -> None:
    family = get_family(model, scheduler)
    request = request_for(model)
    state = started(family, request, 2)
    data = through_bytes(family, state)
    del data["denoised"]
    restored = family.restore(request, state.embeddings, data)
    assert torch.allclose(run_to_end(family, restored), run_to_end(family, state), atol=1e-6, rtol=0)


def test_checkpoint_round_trip_across_a_reschedule_in_a_child_process(
    get_family, data_dir: Path, wan_data_dir: Path, tmp_path: Path
) -> None:
    """Rescheduled here (3 of 6 → 9 in all), checkpointed, finished in another process: as if it had
    stayed here."""
    groups: dict[Path, dict[str, dict[str, Any]]] = {data_dir: {}, wan_data_dir: {}}
    expected = {}
    for model, scheduler in [
        ("tiny-sd", "euler_a"),
        ("tiny-sd", "dpmpp_2m"),
        ("tiny-flux", "flow_euler"),
        ("tiny-wan", "unipc"),
    ]:
        family = get_family(model, scheduler)
        state = family.reschedule(started(family, request_for(model), 3), 9)
        family.step(state)  # the new schedule's first (first-order) step
        key = f"{model}/{scheduler}"
        groups[wan_data_dir if model == "tiny-wan" else data_dir][key] = {
            "model": model,
            "scheduler": scheduler,
            "request": dataclasses.asdict(state.request),
            "embeddings": state.embeddings,
            "checkpoint": family.checkpoint(state),
            "until": 6,
        }
        expected[key] = run_to_end(family, state)
    for root, cases in groups.items():
        out = tmp_path / root.name
        out.mkdir()
        for key, result in resume_in_child(root, cases, out).items():
            assert result["step"] == 9
            assert torch.allclose(result["latents"], expected[key], atol=1e-6, rtol=0), key


# --- the simulated backend ---------------------------------------------------------


@pytest.fixture(scope="module")
def simulated() -> SimulatedFamily:
    return SimulatedFamily(load_registry().get("sdxl-sim"), "cpu", Path("."), time_scale=0.0)


def sim_request(**overrides: Any) -> GenerationRequest:
    return make_request("sdxl-sim", **(dict(width=512, height=512, steps=6) | overrides))


def test_simulated_reschedule_stop_and_extend(simulated: SimulatedFamily, tmp_path: Path) -> None:
    request = sim_request()
    plain = run_to_end(simulated, started(simulated, request, 0))
    state = started(simulated, request, 3)
    assert torch.equal(run_to_end(simulated, simulated.reschedule(state, 6)), plain)
    state = started(simulated, request, 3)
    extended = run_to_end(simulated, simulated.reschedule(state, 10))
    assert torch.isfinite(extended).all() and not torch.allclose(extended, plain)
    # Stopped after 2: the decode is the saved x0 estimate's.
    state = started(simulated, request, 2)
    storage = LocalStorage(tmp_path)
    embeddings_key = storage.put("embeddings/e.pt", blob.dumps(state.embeddings))
    key = stages.save_checkpoint(simulated, storage, state)
    stopped = dataclasses.replace(request, steps=2)
    loaded = stages.load_state(simulated, storage, stopped, embeddings_key, key)
    decoded = pixels(simulated.decode(loaded))
    data = blob.loads(storage.get(key))
    assert data["steps"] == 6
    finished = DenoiseState(request=stopped, step=2, latents=data["denoised"], embeddings=state.embeddings)
    assert np.array_equal(decoded, pixels(simulated.decode(finished)))
    # Old simulated checkpoints (no total, no estimate) restore as before.
    legacy = {"step": 2, "latents": state.latents.clone()}
    assert simulated.restore(request, state.embeddings, legacy).step == 2


@pytest.mark.parametrize(
    "side, size, expected",
    [(1024, (832, 480), (832, 480)), (256, (832, 480), (256, 147)), (256, (1024, 1024), (256, 256))],
)
def test_a_simulated_output_keeps_its_aspect_within_the_side_cap(side: int, size, expected) -> None:
    family = SimulatedFamily(load_registry().get("sdxl-sim"), "cpu", Path("."), time_scale=0.0, output_side=side)
    request = sim_request(width=size[0], height=size[1], steps=1)
    (image,) = family.decode(started(family, request, 1))
    assert image.size == expected
