"""The per-process model cache: load lazily, keep under a byte budget, evict least recently used."""
from __future__ import annotations

import importlib
import logging
import os
from collections import OrderedDict
from pathlib import Path

from genserver.registry import ModelSpec

from . import group
from .base import Family

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
    def __init__(self, budget_bytes: int, data_dir: Path, *, time_scale: float, effective_tflops: float) -> None:
        self.budget_bytes = budget_bytes
        self.data_dir = data_dir
        self.time_scale = time_scale
        self.effective_tflops = effective_tflops
        self._loaded: OrderedDict[str, Family] = OrderedDict()
        self.pid = os.getpid()

    def get(self, spec: ModelSpec) -> Family:
        family = self._loaded.get(spec.name)
        if family is not None:
            self._loaded.move_to_end(spec.name)
            return family
        family = self._load(spec)
        self._loaded[spec.name] = family
        self._evict(keep=spec.name)
        return family

    def _load(self, spec: ModelSpec) -> Family:
        if spec.backend == "simulated":
            from .simulated import SimulatedFamily

            return SimulatedFamily(spec, "cpu", self.data_dir, time_scale=self.time_scale,
                                   effective_tflops=self.effective_tflops)
        module_name, class_name = FAMILY_ADAPTERS[spec.family].split(":")
        log.info("loading %s (%s) from %s", spec.name, spec.family, spec.resolved_path(self.data_dir))
        adapter = getattr(importlib.import_module(module_name), class_name)
        family = adapter(spec, default_device(), self.data_dir)
        # A card group's worker (GENSERVER_GROUP_SIZE=k): the transformer over its k cards where
        # diffusers has context parallelism for the family and CUDA is there; else one device.
        group.maybe_parallelize(family)
        return family

    def _evict(self, keep: str) -> None:
        while self.used_bytes() > self.budget_bytes and len(self._loaded) > 1:
            name = next(n for n in self._loaded if n != keep)
            log.info("model cache over budget: unloading %s", name)
            del self._loaded[name]
            group.release(name)

    def used_bytes(self) -> int:
        return sum(f.memory_bytes() for f in self._loaded.values())

    def loaded(self) -> list[str]:
        return list(self._loaded)


_cache: ModelCache | None = None


def model_cache() -> ModelCache:
    """This process's cache (created on first use, so nothing loads in a fork parent)."""
    global _cache
    if _cache is None or _cache.pid != os.getpid():
        from django.conf import settings

        _cache = ModelCache(settings.MODEL_CACHE_BYTES, settings.DATA_DIR, time_scale=settings.TIME_SCALE,
                            effective_tflops=settings.EFFECTIVE_TFLOPS)
    return _cache


def loaded_models() -> list[str]:
    """Models loaded in this process (the solo pool runs tasks here), for the worker heartbeat."""
    return _cache.loaded() if _cache is not None and _cache.pid == os.getpid() else []
