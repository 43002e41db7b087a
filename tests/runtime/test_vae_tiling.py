"""Large decodes are tiled (the VAE decode is a job's memory peak); small ones are not."""

from __future__ import annotations

import pytest

from tests.runtime.conftest import make_request


@pytest.mark.parametrize("model, frames", [("tiny-sd", 1), ("tiny-flux", 1), ("tiny-wan", 5)])
def test_decode_tiles_above_the_threshold(load_family, wan_family, monkeypatch, model, frames):
    family = wan_family if model == "tiny-wan" else load_family(model)
    request = make_request(model, steps=2, num_frames=frames)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    state = family.prepare(request, embeddings)
    while not state.done:
        family.step(state)
    calls: list[str] = []
    monkeypatch.setattr(family.vae, "enable_tiling", lambda *a, **k: calls.append("on"))
    monkeypatch.setattr(family.vae, "disable_tiling", lambda *a, **k: calls.append("off"))

    monkeypatch.setenv("GENSERVER_VAE_TILE_ABOVE_PIXELS", str(64 * 64))  # 64×64 is not above it
    small = family.decode(state)
    monkeypatch.setenv("GENSERVER_VAE_TILE_ABOVE_PIXELS", str(32 * 32))
    large = family.decode(state)
    assert calls == ["off", "on"]
    assert len(small) == len(large) == 1


def test_tiled_decode_really_runs_in_tiles_and_matches_the_size(load_family, monkeypatch):
    family = load_family("tiny-sd")
    request = make_request("tiny-sd", steps=2, width=128, height=128)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    state = family.prepare(request, embeddings)
    while not state.done:
        family.step(state)
    vae = family.vae
    monkeypatch.setattr(vae, "tile_sample_min_size", 64)  # tiles of 64 px on a tiny model
    monkeypatch.setattr(vae, "tile_latent_min_size", 8)
    used: list[bool] = []
    original = vae.tiled_decode
    monkeypatch.setattr(vae, "tiled_decode", lambda *a, **k: used.append(True) or original(*a, **k))
    monkeypatch.setenv("GENSERVER_VAE_TILE_ABOVE_PIXELS", "0")
    (image,) = family.decode(state)
    monkeypatch.setenv("GENSERVER_VAE_TILE_ABOVE_PIXELS", str(10**9))
    family.decode(state)
    assert used == [True] and image.size == (128, 128)
