"""The memory plan: exact bytes from meta-device builds of the full-size configs, and the fit verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from genserver.registry import load_registry
from genserver.scheduling.pools import default_layout
from workers import memory_plan
from workers.memory_plan import GIB, Component, main, plan_cards, problems_of, stage_components, worst_cache

REPO = Path(__file__).resolve().parents[2]
FULL_SIZE = REPO / "bench" / "full-size.toml"


@pytest.fixture(scope="module")
def registry():
    return load_registry(FULL_SIZE)


@pytest.fixture(autouse=True)
def from_repo_root(monkeypatch):
    # The full-size registry's paths are relative to the repository root.
    monkeypatch.chdir(REPO)


def component(registry, model: str, stage: str, name: str) -> Component:
    return next(c for c in stage_components(registry.get(model), stage) if c.name == name)


@pytest.mark.parametrize(
    "model, stage, name, params, gigabytes",
    [
        # Parameter counts of the public architectures; bytes in the entry's bfloat16 (Wan keeps its
        # norms, modulation table and time embedder in fp32, as its from_pretrained does).
        ("flux.1-dev", "denoise", "transformer", 11_901_408_320, 23.80),
        ("flux.1-dev", "encode", "text_encoder_2", 4_762_310_656, 9.52),  # T5-XXL encoder
        ("flux.1-dev", "encode", "text_encoder", 123_060_480, 0.246),  # CLIP ViT-L
        ("sdxl-base-1.0", "denoise", "unet", 2_567_463_684, 5.13),
        ("sdxl-base-1.0", "encode", "text_encoder_2", 694_659_840, 1.39),  # OpenCLIP bigG
        ("wan2.1-t2v-14b", "denoise", "transformer", 14_288_491_584, 28.6),
        ("wan2.1-t2v-1.3b", "denoise", "transformer", 1_418_996_800, 2.84),
        ("wan2.1-t2v-14b", "encode", "text_encoder", 5_680_910_336, 11.36),  # UMT5-XXL encoder
    ],
)
def test_meta_builds_give_the_public_sizes(registry, model, stage, name, params, gigabytes):
    built = component(registry, model, stage, name)
    assert built.params == params
    assert built.bytes / 1e9 == pytest.approx(gigabytes, rel=0.005)
    assert built.dtype.startswith("bfloat16")


def test_each_stage_holds_only_its_own_modules(registry):
    assert [c.name for c in stage_components(registry.get("flux.1-dev"), "denoise")] == ["transformer"]
    assert [c.name for c in stage_components(registry.get("flux.1-dev"), "decode")] == ["vae"]
    assert {c.name for c in stage_components(registry.get("sdxl-base-1.0"), "encode")} == {
        "text_encoder",
        "text_encoder_2",
    }  # tokenizers hold no tensors and are not built on meta


# bench/gpu_bench.py on one H200 (2026-12-04, docs/BENCHMARKS.md "GPU benchmark"): each stage's peak above the
# weights already resident, MiB, at the bench's shapes.
H200_PEAKS_MIB = {
    ("sdxl-base-1.0", (1024, 1024, 1)): {"encode": 19.5, "denoise": 327.6, "decode": 2.38 * 1024},
    ("flux.1-dev", (1024, 1024, 1)): {"encode": 92.0, "denoise": 478.1, "decode": 2.38 * 1024},
    ("wan2.1-t2v-1.3b", (832, 480, 81)): {"encode": 208.5, "denoise": 3.09 * 1024, "decode": 4.39 * 1024},
    ("wan2.1-t2v-14b", (832, 480, 81)): {"encode": 208.5, "denoise": 7.03 * 1024, "decode": 4.38 * 1024},
}


@pytest.mark.parametrize("model, shape", list(H200_PEAKS_MIB))
def test_estimates_cover_what_a_card_measured(registry, model, shape):
    # A plan that counts less than a card used lets a layout through that runs out of memory.
    from workers.memory_estimates import Shape, activation_bytes

    for stage, peak_mib in H200_PEAKS_MIB[(model, shape)].items():
        estimate_mib = activation_bytes(registry.get(model), stage, Shape(*shape)) / 1024**2
        assert estimate_mib >= peak_mib, f"{model} {stage}: estimated {estimate_mib:.1f} MiB, measured {peak_mib}"
        assert estimate_mib <= 1.5 * peak_mib, f"{model} {stage}: {estimate_mib:.1f} MiB, far above {peak_mib}"


def test_80_gib_card_fits_the_four_models(registry, settings, capsys):
    settings.POOLS = ""  # the generated layout, as the launcher would start it
    status = main(["--registry", str(FULL_SIZE), "--card-gib", "80", "--gpus", "1", "--cache-gib", "40"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "card 0: 80.00 GiB; workers gpu0 [denoise], encode [encode], decode [decode]" in out.out
    assert "at the default shapes: fits" in out.out
    assert "flux.1-dev           default  1024×1024" in out.out  # the headroom per job shape


def test_24_gib_card_refuses_flux_naming_what_to_change(registry, settings, capsys):
    settings.POOLS = ""
    status = main(["--registry", str(FULL_SIZE), "--card-gib", "24", "--gpus", "1", "--cache-gib", "40"])
    err = capsys.readouterr().err
    assert status == 1
    flux = next(line for line in err.splitlines() if "flux.1-dev does not fit" in line)
    assert flux.startswith("DOES NOT FIT: card 0 (24.00 GiB)")
    assert "transformer alone is 22.17 GiB in bfloat16" in flux
    assert 'encode_device = "cpu" on [models."flux.1-dev"]' in flux
    assert "a smaller dtype" in flux and "more cards" in flux


def test_encode_device_cpu_takes_the_text_encoders_off_the_card(tmp_path):
    entry = FULL_SIZE.read_text().split('[models."flux.1-dev"]')[1].split("[models.")[0]
    entry = entry.replace('path = "bench/full-size/flux.1-dev"', f'path = "{REPO}/bench/full-size/flux.1-dev"')
    plain, offloaded = tmp_path / "plain.toml", tmp_path / "offloaded.toml"
    plain.write_text('[models."flux.1-dev"]' + entry)
    offloaded.write_text('[models."flux.1-dev"]\nencode_device = "cpu"' + entry)
    layout = default_layout(num_gpus=1)
    refused = plan_cards(layout, load_registry(plain), 32 * GIB, 40 * GIB)
    assert any("flux.1-dev does not fit" in p for p in problems_of(refused))
    fits = plan_cards(layout, load_registry(offloaded), 32 * GIB, 40 * GIB)
    assert problems_of(fits) == []
    assert "text_encoder_2" not in {c.name for c in fits[0].resident}


def test_two_cards_put_encode_and_decode_beside_the_video_card(registry):
    cards = plan_cards(default_layout(num_gpus=2), registry, 80 * GIB, 40 * GIB)
    assert [[w.name for w, _, _ in card.workers] for card in cards] == [["gpu0"], ["gpu1", "encode", "decode"]]
    assert {c.stage for c in cards[0].resident} == {"denoise"}
    assert problems_of(cards) == []


def test_a_model_that_encodes_on_its_card_keeps_its_text_encoders_on_every_denoise_card(tmp_path):
    """SDXL with `encode_on_card` on two cards: gpu0 (denoise only) holds its CLIPs beside the UNet; and the
    80-GiB card of the four models does not fit with them (78.49 GiB + the CLIPs and their activations = 80.02
    GiB), which is why full-size.toml leaves it off."""
    entry = FULL_SIZE.read_text().split('[models."sdxl-base-1.0"]')[1].split("[models.")[0]
    entry = entry.replace('path = "bench/full-size/', f'path = "{REPO}/bench/full-size/')
    on_card = tmp_path / "on-card.toml"
    on_card.write_text('[models."sdxl-base-1.0"]\nencode_on_card = true' + entry)
    cards = plan_cards(default_layout(num_gpus=2), load_registry(on_card), 80 * GIB, 40 * GIB)
    held = {(c.stage, c.name) for c in cards[0].resident}
    assert held == {("denoise", "unet"), ("encode", "text_encoder"), ("encode", "text_encoder_2")}
    four = (
        FULL_SIZE.read_text()
        .replace('[models."sdxl-base-1.0"]', '[models."sdxl-base-1.0"]\nencode_on_card = true')
        .replace('path = "bench/full-size/', f'path = "{REPO}/bench/full-size/')
    )
    (tmp_path / "four.toml").write_text(four)
    refused = plan_cards(default_layout(num_gpus=1), load_registry(tmp_path / "four.toml"), 80 * GIB, 40 * GIB)
    assert any("gpu0 35.63 GiB" in p and "= 80.02 GiB" in p for p in problems_of(refused)), problems_of(refused)


def test_a_worker_cache_holds_the_largest_set_within_its_budget():
    def entry(name: str, gib: float) -> list[Component]:
        return [Component(name, "denoise", "transformer", "bfloat16", 0, int(gib * GIB))]

    entries = [entry("a", 30), entry("b", 20), entry("c", 15), entry("d", 4)]
    assert {c.model for c in worst_cache(entries, 40 * GIB)} == {"b", "c", "d"}  # 39 GiB
    assert {c.model for c in worst_cache(entries, 10 * GIB)} == {"a"}  # one above the budget still loads
    assert worst_cache([], 40 * GIB) == []


def test_launcher_refuses_a_layout_that_does_not_fit(registry, settings, monkeypatch):
    from genserver import deployment
    from workers.launcher import refuse_unfit_layout

    settings.REGISTRY_PATH = str(FULL_SIZE)
    deployment.registry.cache_clear()
    monkeypatch.setattr(memory_plan, "detected_card_bytes", lambda: 24 * GIB)
    try:
        with pytest.raises(SystemExit, match="nothing started") as refused:
            refuse_unfit_layout(default_layout(num_gpus=1))
        assert "flux.1-dev does not fit" in str(refused.value)
        refuse_unfit_layout(default_layout(num_gpus=0))  # CPU workers: no card to fill
        monkeypatch.setattr(memory_plan, "detected_card_bytes", lambda: 80 * GIB)
        refuse_unfit_layout(default_layout(num_gpus=1))
    finally:
        deployment.registry.cache_clear()


def test_launcher_counts_only_checkpoints_that_exist(settings, monkeypatch):
    # The bundled registry: simulated entries hold nothing, and the tiny checkpoints' folders
    # (under the test data dir) are not there, so a 1 GiB card is no reason to refuse.
    from genserver import deployment
    from workers.launcher import refuse_unfit_layout

    settings.REGISTRY_PATH = str(REPO / "genserver" / "registry.toml")
    deployment.registry.cache_clear()
    monkeypatch.setattr(memory_plan, "detected_card_bytes", lambda: 1 * GIB)
    settings.DATA_DIR = Path("/nonexistent-genserver-data")  # pytest-django's wrapper puts it back
    try:
        refuse_unfit_layout(default_layout(num_gpus=1))
    finally:
        deployment.registry.cache_clear()
