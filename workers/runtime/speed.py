"""The speed options of a registry entry: compile, attention backend, and the warm-up at worker start.

    compile = true        torch.compile of the denoiser: per repeated block (diffusers'
                          `compile_repeated_blocks`, regional compilation: the UNet's transformer
                          blocks, FLUX's double/single blocks, Wan's blocks) where the class lists
                          them, else the whole module. The first call compiles (tens of seconds
                          on a big model), so the worker runs one step at the entry's default
                          shape before it takes any job: a compile never looks like a dead worker.
    attention = "NAME"    diffusers' attention backend for the denoiser (`set_attention_backend`,
                          e.g. "flash", "_native_cudnn", "sage"; diffusers' AttentionBackendName)
    encode_device = "cpu" text encoders on the CPU (Family.load_components), for cards too small

All default off. The warm-up runs in the worker process that serves the jobs
(tasks/common.py connects it to Celery's worker start).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from genserver import config
from genserver.registry import ModelSpec, Registry

log = logging.getLogger(__name__)

# Passed to torch.compile for every compiled block (inductor, the default backend, on CUDA; the CPU
# tests trace with backend "eager": inductor's C++ build of even a tiny model takes minutes there).
COMPILE_OPTIONS: dict[str, Any] = {}


def apply_speed_options(family: Any) -> None:
    """Set the entry's attention backend and compile its denoiser (if this instance holds one)."""
    spec: ModelSpec = family.spec
    denoiser = family.denoiser
    if denoiser is None:
        return
    if spec.attention:
        from diffusers.models.attention_dispatch import AttentionBackendName

        known = sorted(b.value for b in AttentionBackendName)
        if spec.attention not in known:
            raise ValueError(
                f"model {spec.name!r}: attention = {spec.attention!r} is not a diffusers attention "
                f"backend; known: {known}"
            )
        denoiser.set_attention_backend(spec.attention)
    if spec.compile:
        if getattr(denoiser, "_repeated_blocks", None):
            denoiser.compile_repeated_blocks(**COMPILE_OPTIONS)  # regional: each block compiled once, reused
        else:
            denoiser.compile(**COMPILE_OPTIONS)
        family.needs_warm_up = True


def warm_up(family: Any) -> float:
    """One step at the entry's default shape with blank embeddings (the first compiled call);
    returns its seconds. A no-op unless the denoiser was compiled."""
    if not getattr(family, "needs_warm_up", False):
        return 0.0
    started = time.perf_counter()
    family.warm_up()
    family.needs_warm_up = False
    seconds = time.perf_counter() - started
    log.info("warmed up %s (compiled denoiser) in %.1f s", family.spec.name, seconds)
    return seconds


def models_to_warm_up(registry: Registry, worker_models: Iterable[str], denoises: bool) -> list[ModelSpec]:
    """The `compile = true` diffusers entries this worker will denoise: its dedicated models, or
    every entry when it has none. None if it takes no denoise queue."""
    if not denoises:
        return []
    names = [m for m in worker_models if m] or registry.names()
    specs = [registry.get(name) for name in names]
    return [s for s in specs if s.compile and s.backend == "diffusers"]


def warm_up_worker(registry: Registry, load_denoiser: Callable[[ModelSpec], Any]) -> list[str]:
    """At worker start: load and warm up each compiled denoiser this worker serves (from the
    launcher's GENSERVER_WORKER_MODELS / GENSERVER_WORKER_QUEUES). Returns the models warmed."""
    from genserver.scheduling.pools import CLASSES, class_of

    queues = config.worker_queues()
    denoises = not queues or any(class_of(q) in CLASSES for q in queues)
    specs = models_to_warm_up(registry, config.worker_models(), denoises)
    for spec in specs:
        warm_up(load_denoiser(spec))
    return [spec.name for spec in specs]
