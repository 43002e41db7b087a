"""bench.gpu_bench on the CPU: its per-model routine on the tiny checkpoints (the GPU run's code path,
tiny shape), the download-free tokenizers of the full-size trees, and its refusal without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench import gpu_bench
from genserver.registry import load_registry
from genserver.storage import LocalStorage
from tests.support.tiny_models import copy_tiny_models

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the benchmark would run")
def test_exits_2_without_cuda(capsys):
    assert gpu_bench.main([]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny-sdxl", "tiny-flux", "tiny-wan"])
def test_per_model_routine_runs_stock_and_ours_on_the_same_modules(model, tmp_path):
    copy_tiny_models(tmp_path / "models")
    spec = gpu_bench.config_tree_with_tokenizers(load_registry().get(model), tmp_path, tmp_path)
    request = gpu_bench.bench_request(spec, *gpu_bench.TINY[model])
    result = gpu_bench.bench_model(spec, request, "cpu", "checkpoint", LocalStorage(tmp_path / "storage"))
    assert result.bit_exact  # restored from the middle checkpoint, ran to the same latents
    assert result.stock_step_s > 0 and result.ours_step_s > 0 and result.decode_s > 0
    assert result.save_s > 0 and result.restore_s > 0 and result.preview_s > 0
    assert all(result.weights[stage] > 0 for stage in ("encode", "denoise", "decode"))
    row = result.row()
    assert result.rounds == gpu_bench.ROUNDS  # a tiny model's stock call is short: alternated
    assert row.startswith(f"| {model} | 64×64") and row.endswith(f"| yes | {gpu_bench.ROUNDS} |")
    assert row.count("|") == gpu_bench.TABLE_HEADER.splitlines()[0].count("|")


def test_runs_where_django_is_not_installed(tmp_path):
    # The GPU machine's image has torch and transformers but no Django: the benchmark (and the model
    # runtime under it) must run without it. A child process where `import django` fails runs one model.
    copy_tiny_models(tmp_path / "models")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["django"] = None  # import django: ImportError, as where it is not installed
        from pathlib import Path
        from bench import gpu_bench
        from genserver.registry import load_registry
        from genserver.storage import LocalStorage
        tmp = Path({str(tmp_path)!r})
        spec = gpu_bench.config_tree_with_tokenizers(load_registry().get("tiny-sdxl"), tmp, tmp)
        request = gpu_bench.bench_request(spec, *gpu_bench.TINY["tiny-sdxl"])
        result = gpu_bench.bench_model(spec, request, "cpu", "checkpoint", LocalStorage(tmp / "storage"))
        assert result.bit_exact and "django.conf" not in sys.modules
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    "model, folders",
    [
        ("flux.1-dev", {"tokenizer": 77, "tokenizer_2": 512}),
        ("sdxl-base-1.0", {"tokenizer": 77, "tokenizer_2": 77}),
        ("wan2.1-t2v-14b", {"tokenizer": 512}),
    ],
)
def test_full_size_trees_get_download_free_tokenizers(model, folders, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.chdir(REPO)
    spec = gpu_bench.config_tree_with_tokenizers(load_registry(REPO / "bench" / "full-size.toml").get(model), tmp_path)
    tree = Path(spec.path)
    assert tree.parent == tmp_path and not list(tree.rglob("*.safetensors"))
    encoders = {"tokenizer": "text_encoder", "tokenizer_2": "text_encoder_2"}
    for folder, length in folders.items():
        tokenizer = AutoTokenizer.from_pretrained(tree / folder, local_files_only=True)
        ids = tokenizer(["a red fox in the snow"], padding="max_length", max_length=length, truncation=True).input_ids[
            0
        ]
        vocab = json.loads((tree / encoders[folder] / "config.json").read_text())["vocab_size"]
        assert len(ids) == length and max(ids) < vocab  # real sequence length, ids inside the real vocabulary


def test_every_family_adapter_takes_the_full_size_modules(tmp_path, monkeypatch):
    # The GPU run's build, on the meta device: each full-size tree gives its family adapter (as a worker
    # loads it) the prebuilt modules of every stage, shapes and configs read from the real architecture.
    from bench.runtime import load_family
    from workers.runtime import components

    monkeypatch.chdir(REPO)
    registry = load_registry(REPO / "bench" / "full-size.toml")
    expected = {"unet": "UNetFamily", "flux": "FluxFamily", "wan": "WanFamily"}
    for name in registry.names():
        spec = gpu_bench.config_tree_with_tokenizers(registry.get(name), tmp_path)
        modules = {
            stage: components.build_stage(spec, stage, device="cuda", weights="meta") for stage in components.STAGES
        }
        for component, cls in components.stage_components(spec, "encode").items():
            if components.is_tokenizer(cls):  # meta builds skip tokenizers; the random build loads these
                modules["encode"][component] = cls.from_pretrained(Path(spec.path) / component, local_files_only=True)
        with gpu_bench.prebuilt(modules):
            family = load_family(spec, "cpu", tmp_path)
        assert type(family).__name__ == expected[spec.family]
        assert all(family.components[c] is m for stage in modules.values() for c, m in stage.items())
