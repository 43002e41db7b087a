"""Card groups at run time: one job over k devices with diffusers' context parallelism.

A card group is one worker process that sees k cards (the launcher sets
CUDA_VISIBLE_DEVICES to all of them and GENSERVER_GROUP_SIZE=k) and runs one
job at a time. Where the family's transformer has a diffusers context-parallel
plan (`_cp_plan`: Wan, FLUX, ...) and the process sees k CUDA devices, the
worker becomes rank 0 of a k-process torch.distributed group:

* `TransformerGroup.start` spawns k - 1 follower processes (ranks 1..k-1);
* `parallelize` has every follower load the same transformer on its own
  device, and calls `enable_parallelism(ContextParallelConfig(ulysses_degree=k))`
  on every rank (Ulysses attention: each rank holds 1/k of the sequence and
  all-to-alls the heads; the plan gathers the output, so every rank ends with
  the whole result);
* a forward pre-hook on rank 0's transformer broadcasts each call's arguments
  before it runs, so the followers make the same call with it. The family
  adapter's step code is unchanged: it calls its transformer as always.

Everywhere else the group runs the job on one device, like a single card:
on CPU (production), with fewer CUDA devices than k, without torch.distributed,
or for a family whose transformer has no plan (the UNet families) or whose
head count k does not divide. `why_single` says which, and the log says so.

What is tested where (docs/ARCHITECTURE.md, "Card groups"): the mechanism
(follower processes, the broadcast, Ulysses on the tiny Wan and FLUX
transformers) runs on CPU with the gloo backend in the tests and matches the
single-process output; ring attention does not run there (the native attention
backend returns no log-sum-exp). The CUDA/NCCL path is the same code with
backend "nccl" and one device per rank, untested in this project: no machine
here has two GPUs.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from genserver import config

log = logging.getLogger(__name__)

# A collective that waits longer than this fails (a follower died): the task fails, the
# job's attempt counts and it is retried from its checkpoint, like any worker crash.
COLLECTIVE_TIMEOUT = timedelta(seconds=config.group_timeout_seconds())


def group_size() -> int:
    """k of this worker: GENSERVER_GROUP_SIZE, set by the launcher for a pool entry with k devices."""
    return config.group_size()


def why_single(transformer: Any, k: int, *, allow_cpu: bool = False) -> str:
    """Why a group of `k` runs this transformer on one device ("" when it can run on all k)."""
    import torch

    if k < 2:
        return "a group of one"
    if transformer is None or getattr(transformer, "_cp_plan", None) is None:
        return f"diffusers has no context-parallel plan for {type(transformer).__name__}"
    heads = getattr(getattr(transformer, "config", None), "num_attention_heads", None)
    if heads is not None and heads % k:
        return f"{heads} attention heads do not split over {k} ranks (Ulysses)"
    if not torch.distributed.is_available():
        return "torch.distributed is not available"
    if allow_cpu:
        return ""
    if not torch.cuda.is_available():
        return "no CUDA device (on CPU a group runs its job on one device)"
    if torch.cuda.device_count() < k:
        return f"{torch.cuda.device_count()} CUDA devices visible, the group needs {k}"
    return ""


@contextlib.contextmanager
def _cpu_mesh() -> Iterator[None]:
    """diffusers 0.42 picks the rank's device as `rank % torch.accelerator.device_count()`, a division
    by zero on a CPU-only machine; CPU ranks all use "cpu", so one device is the truth there."""
    import torch

    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def enable_context_parallel(transformer: Any, k: int) -> None:
    from diffusers import ContextParallelConfig

    with _cpu_mesh():
        transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=k))


def _move(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


def _broadcast(message: Any = None) -> Any:
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _load(source: tuple[str, str, str]) -> Any:
    """A transformer from (class "module:Name", directory, dtype name), as the family loads it."""
    import torch

    from .components import load_pretrained

    class_path, directory, dtype = source
    module, name = class_path.split(":")
    cls = getattr(importlib.import_module(module), name)
    return load_pretrained(cls, Path(directory), getattr(torch, dtype)).eval()


def _device(backend: str, rank: int) -> Any:
    import torch

    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _follower(rank: int, k: int, backend: str, init_method: str) -> None:
    """Ranks 1..k-1: load what rank 0 loads, and make every call it makes."""
    import torch
    import torch.distributed as dist

    device = _device(backend, rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=k, timeout=COLLECTIVE_TIMEOUT)
    models: dict[str, Any] = {}
    try:
        while True:
            op, name, payload = _broadcast()
            if op == "stop":
                break
            if op == "load":
                models[name] = _load(payload).to(device)
                enable_context_parallel(models[name], k)
            elif op == "drop":
                models.pop(name, None)
            elif op == "call":
                args, kwargs = _move(payload, device)
                with torch.no_grad():
                    models[name](*args, **kwargs)
    finally:
        dist.destroy_process_group()


class TransformerGroup:
    """Rank 0 of a group of k processes running transformers with context parallelism.

    One per worker process (torch.distributed has one default group per process);
    every model the worker loads that can be parallelized joins it.
    """

    def __init__(self, k: int, backend: str | None = None) -> None:
        import torch

        self.k = k
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._followers: list[Any] = []
        self._names: set[str] = set()
        self._dir = tempfile.mkdtemp(prefix="genserver-group-")

    def start(self) -> TransformerGroup:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        init_method = f"file://{self._dir}/rendezvous"
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA state
        self._followers = [
            ctx.Process(
                target=_follower, args=(rank, self.k, self.backend, init_method), name=f"group-rank{rank}", daemon=True
            )
            for rank in range(1, self.k)
        ]
        for process in self._followers:
            process.start()
        _device(self.backend, 0)
        dist.init_process_group(
            self.backend, init_method=init_method, rank=0, world_size=self.k, timeout=COLLECTIVE_TIMEOUT
        )
        log.info("card group of %d started (%s backend)", self.k, self.backend)
        return self

    def parallelize(self, name: str, transformer: Any, source: tuple[str, str, str]) -> None:
        """Split `transformer` (already on rank 0's device) over the group; the followers load it from
        `source` (see `_load`). From now on each of its calls runs on all k ranks."""
        _broadcast(("load", name, source))
        enable_context_parallel(transformer, self.k)

        def mirror(module: Any, args: tuple, kwargs: dict) -> None:
            _broadcast(("call", name, _move((args, kwargs), "cpu")))

        transformer.register_forward_pre_hook(mirror, with_kwargs=True)
        self._names.add(name)

    def release(self, name: str) -> None:
        if name in self._names:
            self._names.discard(name)
            _broadcast(("drop", name, None))

    def close(self) -> None:
        import torch.distributed as dist

        if not self._followers:
            return
        with contextlib.suppress(Exception):
            _broadcast(("stop", "", None))
        for process in self._followers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._followers = []
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


_group: TransformerGroup | None = None


def source_of(transformer: Any, directory: Any) -> tuple[str, str, str]:
    cls = type(transformer)
    return f"{cls.__module__}:{cls.__name__}", str(directory), str(transformer.dtype).removeprefix("torch.")


def maybe_parallelize(family: Any) -> str:
    """In a card group's worker, split the family's transformer over the group's cards. Returns
    "" when it did, else why the job runs on one device (nothing to do outside a group)."""
    global _group
    k = group_size()
    if k < 2:
        return "a group of one"
    transformer = getattr(family, "transformer", None)
    reason = why_single(transformer, k)
    directory = getattr(family, "path", None)
    if not reason and (directory is None or not (directory / "transformer").is_dir()):
        reason = "no transformer/ directory the followers can load"
    if reason:
        log.info("card group of %d: %s runs on one device: %s", k, family.spec.name, reason)
        return reason
    if _group is None:
        _group = TransformerGroup(k).start()
    _group.parallelize(family.spec.name, transformer, source_of(transformer, directory / "transformer"))
    log.info("card group of %d: %s runs with context parallelism (Ulysses) over %d cards", k, family.spec.name, k)
    return ""


def release(name: str) -> None:
    """The cache unloaded a model: the followers drop their copy too."""
    if _group is not None:
        _group.release(name)
