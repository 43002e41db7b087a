"""The speed options (workers/runtime/speed.py): a compiled denoiser is warmed up at worker start, before
any job; the attention backend is diffusers'; encode_device puts the text encoders on the CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from genserver.registry import Registry, load_registry
from workers.runtime import speed
from workers.runtime.cache import ModelCache
from workers.runtime.flux import FluxFamily

from .conftest import make_request


def compiled_blocks(module: torch.nn.Module) -> list[str]:
    """The submodules torch.compile wraps (nn.Module.compile sets _compiled_call_impl)."""
    return [name for name, sub in module.named_modules() if getattr(sub, "_compiled_call_impl", None) is not None]


def test_compile_wraps_each_repeated_block_and_the_worker_start_warms_it_up(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At worker start (a worker on a denoise queue, dedicated to the compiled model) the denoiser is loaded,
    its repeated blocks compiled, and one step run at the default shape, before any job; the compiled
    model then gives the uncompiled one's latents."""
    monkeypatch.setattr(speed, "COMPILE_OPTIONS", {"backend": "eager"})  # trace, skip inductor's C++ build
    registry = load_registry()
    spec = dataclasses.replace(registry.get("tiny-flux"), name="tiny-flux-compiled", compile=True)
    registry = Registry(registry.models | {spec.name: spec})
    cache = ModelCache(10**12, data_dir, time_scale=0.0, effective_tflops=450.0)
    monkeypatch.setenv("GENSERVER_WORKER_QUEUES", "encode,short.tiny-flux-compiled,decode")
    monkeypatch.setenv("GENSERVER_WORKER_MODELS", "tiny-flux-compiled")

    warmed = speed.warm_up_worker(registry, lambda s: cache.get(s, "denoise"))

    assert warmed == ["tiny-flux-compiled"]
    family = cache.get(spec, "denoise")
    blocks = compiled_blocks(family.transformer)
    assert blocks and all(
        type(family.transformer.get_submodule(b)).__name__ in family.transformer._repeated_blocks for b in blocks
    )
    assert family.needs_warm_up is False
    assert cache.memory() == {"tiny-flux-compiled/denoise": family.memory_by_component()}
    plain = FluxFamily(registry.get("tiny-flux"), "cpu", data_dir, ("denoise",))
    request = make_request("tiny-flux", steps=2)
    states = [f.prepare(request, plain.blank_embeddings()) for f in (family, plain)]
    for f, state in zip((family, plain), states):
        f.step(state)
    torch.testing.assert_close(states[0].latents, states[1].latents)


def test_only_compiled_diffusers_models_a_worker_denoises_are_warmed_up(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = load_registry()
    compiled = dataclasses.replace(registry.get("tiny-sd"), name="sd-c", compile=True)
    registry = Registry(registry.models | {"sd-c": compiled})
    assert [s.name for s in speed.models_to_warm_up(registry, [""], denoises=True)] == ["sd-c"]
    assert speed.models_to_warm_up(registry, ["tiny-sd"], denoises=True) == []
    assert speed.models_to_warm_up(registry, ["sd-c"], denoises=False) == []
    monkeypatch.setenv("GENSERVER_WORKER_QUEUES", "encode,decode")  # an encode/decode worker compiles nothing
    loaded: list[str] = []
    assert speed.warm_up_worker(registry, lambda s: loaded.append(s.name)) == [] and loaded == []


def test_attention_backend_is_set_on_the_denoiser_and_a_wrong_name_lists_the_known(data_dir: Path) -> None:
    spec = dataclasses.replace(load_registry().get("tiny-flux"), attention="native")
    family = FluxFamily(spec, "cpu", data_dir, ("denoise",))
    processors = [m.processor for m in family.transformer.modules() if hasattr(m, "processor")]
    assert processors and all(getattr(p, "_attention_backend", None) == "native" for p in processors)
    with pytest.raises(ValueError, match="not a diffusers attention backend; known: .*native"):
        FluxFamily(dataclasses.replace(spec, attention="fast"), "cpu", data_dir, ("denoise",))


def test_encode_device_cpu_keeps_the_text_encoders_on_the_cpu(data_dir: Path) -> None:
    spec = dataclasses.replace(load_registry().get("tiny-flux"), encode_device="cpu")
    family = FluxFamily(spec, "cpu", data_dir, ("encode",))
    assert family.encode_device == "cpu"
    assert {p.device.type for m in (family.text_encoder, family.text_encoder_2) for p in m.parameters()} == {"cpu"}
    assert family.encode([("a cat", "")])[0]["prompt_embeds"].device.type == "cpu"
