"""Card groups at run time: a group of 2 ranks (gloo, CPU) runs the family's own step code with
diffusers' context parallelism (Ulysses) and gives the one-device result; on CPU in production,
and for a family without a context-parallel plan, a group runs the job on one device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from genserver.registry import ModelSpec, load_registry
from tests.runtime.conftest import generate, make_request
from workers.runtime import group as group_runtime
from workers.runtime.base import Family
from workers.runtime.group import TransformerGroup, maybe_parallelize, source_of, why_single


@pytest.fixture(scope="module")
def group():
    """Rank 0 here, rank 1 in a spawned follower; closed (and the process group destroyed) after."""
    g = TransformerGroup(2, backend="gloo").start()
    yield g
    g.close()


def _parallel_matches_single(
    group: TransformerGroup, family_class: Callable[..., Family], spec: ModelSpec, data_dir: Path, request
) -> None:
    single = generate(family_class(spec, "cpu", data_dir), request)
    family = family_class(spec, "cpu", data_dir)
    assert why_single(family.transformer, 2, allow_cpu=True) == ""
    group.parallelize(spec.name, family.transformer, source_of(family.transformer, family.path / "transformer"))
    calls = []
    family.transformer.register_forward_hook(lambda module, args, out: calls.append(1))
    parallel = generate(family, request)
    assert len(calls) == request.steps  # every step ran through the group (one CFG-batched call each)
    torch.testing.assert_close(parallel, single, rtol=1e-4, atol=1e-5)
    group.release(spec.name)


def test_wan_and_flux_on_a_group_of_two_match_one_device(
    group, wan_spec: ModelSpec, wan_data_dir: Path, data_dir: Path
) -> None:
    from workers.runtime.flux import FluxFamily
    from workers.runtime.wan import WanFamily

    _parallel_matches_single(
        group, WanFamily, wan_spec, wan_data_dir, make_request("tiny-wan", width=64, height=64, num_frames=9, steps=3)
    )
    _parallel_matches_single(
        group,
        FluxFamily,
        load_registry().get("tiny-flux"),
        data_dir,
        make_request("tiny-flux", width=64, height=64, steps=3),
    )


def test_on_cpu_and_without_a_plan_a_group_runs_on_one_device(monkeypatch, load_family, wan_family) -> None:
    monkeypatch.setenv("GENSERVER_GROUP_SIZE", "2")
    monkeypatch.setattr(group_runtime, "_group", None)
    # Production on CPU: the job runs on one device, no process group is started.
    assert "no CUDA device" in maybe_parallelize(wan_family)
    assert group_runtime._group is None
    unet = load_family("tiny-sd")
    assert "no context-parallel plan" in why_single(getattr(unet, "unet", None), 2, allow_cpu=True)
    assert "do not split" in why_single(wan_family.transformer, 4, allow_cpu=True)  # 2 heads over 4 ranks
    monkeypatch.setenv("GENSERVER_GROUP_SIZE", "1")
    assert maybe_parallelize(wan_family) == "a group of one"
