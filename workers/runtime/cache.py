"""The per-process caches: models (load lazily, keep under a byte budget, evict least recently used), and the
prompt embeddings read from storage.

Models are keyed by (model, stage): an encode task loads the model's text encoders, a denoise
task its UNet or transformer, a decode task its VAE (components.py), so a worker
that serves all three holds each component once. The budget counts real bytes
(parameters + buffers × element size) of what is loaded.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from genserver import config
from genserver.registry import ModelSpec

from . import group
from .base import STAGES, Family

log = logging.getLogger(__name__)

# The diffusers adapter of each family, imported only when a model of it loads.
FAMILY_ADAPTERS: dict[str, str] = {
    "unet": "workers.runtime.unet:UNetFamily",
    "flux": "workers.runtime.flux:FluxFamily",
    "wan": "workers.runtime.wan:WanFamily",
}


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ModelCache:
    def __init__(
        self,
        budget_bytes: int,
        data_dir: Path,
        *,
        time_scale: float,
        effective_tflops: float,
        sim_output_side: int = 1024,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.data_dir = data_dir
        self.time_scale = time_scale
        self.effective_tflops = effective_tflops
        self.sim_output_side = sim_output_side
        self._loaded: OrderedDict[str, Family] = OrderedDict()
        self.pid = os.getpid()

    def get(self, spec: ModelSpec, stage: str | None = None) -> Family:
        """The model with `stage`'s components loaded (None: every stage in one instance)."""
        if stage is not None and stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")
        key = (spec.name, stage or "all")
        family = self._loaded.get(key)
        if family is not None:
            self._loaded.move_to_end(key)
            return family
        family = self._load(spec, STAGES if stage is None else (stage,))
        self._loaded[key] = family
        self._evict(keep=key)
        return family

    def _load(self, spec: ModelSpec, stages: tuple[str, ...]) -> Family:
        if spec.backend == "simulated":
            from .simulated import SimulatedFamily

            return SimulatedFamily(
                spec,
                "cpu",
                self.data_dir,
                time_scale=self.time_scale,
                effective_tflops=self.effective_tflops,
                output_side=self.sim_output_side,
            )
        module_name, class_name = FAMILY_ADAPTERS[spec.family].split(":")
        log.info(
            "loading %s (%s, %s) from %s", spec.name, spec.family, "/".join(stages), spec.resolved_path(self.data_dir)
        )
        adapter = getattr(importlib.import_module(module_name), class_name)
        family = adapter(spec, default_device(), self.data_dir, stages)
        if "denoise" in stages:
            # A card group's worker (GENSERVER_GROUP_SIZE=k): the transformer over its k cards where
            # diffusers has context parallelism for the family and CUDA is there; else one device.
            group.maybe_parallelize(family)
        return family

    def _evict(self, keep: tuple[str, str]) -> None:
        while self.used_bytes() > self.budget_bytes and len(self._loaded) > 1:
            key = next(k for k in self._loaded if k != keep)
            log.info("model cache over budget: unloading %s (%s)", *key)
            del self._loaded[key]
            if key[1] in ("denoise", "all"):
                group.release(key[0])

    def used_bytes(self) -> int:
        return sum(f.memory_bytes() for f in self._loaded.values())

    def memory(self) -> dict[str, dict[str, dict[str, int]]]:
        """{"model/stage": {component: {dtype: bytes}}} of everything loaded."""
        return {f"{name}/{stage}": family.memory_by_component() for (name, stage), family in self._loaded.items()}

    def loaded(self) -> list[str]:
        """The models with at least one stage loaded, least recently used first."""
        return list(dict.fromkeys(name for name, _ in self._loaded))


_cache: ModelCache | None = None


def model_cache() -> ModelCache:
    """This process's cache (created on first use, so nothing loads in a fork parent)."""
    global _cache
    if _cache is None or _cache.pid != os.getpid():
        from django.conf import settings

        _cache = ModelCache(
            settings.MODEL_CACHE_BYTES,
            settings.DATA_DIR,
            time_scale=settings.TIME_SCALE,
            effective_tflops=settings.EFFECTIVE_TFLOPS,
            sim_output_side=settings.SIM_OUTPUT_SIDE,
        )
    return _cache


def loaded_models() -> list[str]:
    """Models loaded in this process (the solo pool runs tasks here), for the worker heartbeat."""
    return _cache.loaded() if _cache is not None and _cache.pid == os.getpid() else []


class EmbeddingsCache:
    """Prompt embeddings this process has read, by storage and key, under a byte budget (least recently used out).

    Only keys that name their content are kept (storage.keys.names_its_content: the text encoder and the prompts'
    digest), so an entry never goes stale. The families read embeddings and never change them in place (each step
    takes `.to(device, dtype)` copies), so every job of a prompt shares one dict. An entry larger than the whole
    budget is not kept.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self._used = 0
        self.hits = self.misses = 0

    def get(self, key: str, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The embeddings stored under `key`: from memory, else `read()` (and kept)."""
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found[0]
        self.misses += 1
        embeddings = read()
        size = _tensor_bytes(embeddings)
        if size <= self.budget_bytes:
            self._entries[key] = (embeddings, size)
            self._used += size
            while self._used > self.budget_bytes:
                self._used -= self._entries.popitem(last=False)[1][1]
        return embeddings

    def used_bytes(self) -> int:
        return self._used


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    numel, element_size = getattr(value, "numel", None), getattr(value, "element_size", None)
    return numel() * element_size() if callable(numel) and callable(element_size) else 0


_embeddings: EmbeddingsCache | None = None


def embeddings_cache() -> EmbeddingsCache:
    """This process's embeddings cache (GENSERVER_EMBEDDINGS_CACHE_BYTES; created on first use)."""
    global _embeddings
    if _embeddings is None:
        _embeddings = EmbeddingsCache(config.embeddings_cache_bytes())
    return _embeddings
