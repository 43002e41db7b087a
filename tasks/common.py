"""What every stage task needs: who this worker is, and the job as the runtime sees it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from celery.signals import (
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)
from django.db import close_old_connections

from genserver import config, deployment
from genserver.jobs import events, flags
from genserver.jobs.models import Job
from genserver.registry import ModelSpec
from genserver.scheduling.classes import CLASSES
from genserver.scheduling.pools import class_of
from genserver.storage import default_storage
from workers.runtime.base import Family, GenerationRequest
from workers.runtime.cache import model_cache


def worker_id(task) -> str:
    """Unique per worker process, so a restarted worker never mistakes an old lease for its own."""
    return f"{task.request.hostname or 'worker'}:{os.getpid()}"


def request_of(job: Job) -> GenerationRequest:
    return GenerationRequest(
        job_id=str(job.pk),
        model=job.model,
        prompt=job.prompt,
        negative_prompt=job.negative_prompt,
        width=job.width,
        height=job.height,
        num_frames=job.num_frames,
        steps=job.steps,
        guidance_scale=job.guidance_scale,
        seed=job.seed,
        num_outputs=job.num_outputs,
    )


def family_of(job: Job, stage: str) -> Family:
    """The job's model with `stage`'s components loaded ("encode", "denoise" or "decode")."""
    return model_cache().get(deployment.registry().get(job.model), stage)


class CardEncoder:
    """A model's text encoders on the denoising card (the registry's `encode_on_card`), for stages.load_state to
    call when a job's embeddings are not stored yet; `encoded` says whether it was called (the card counts the
    job's lookup: a miss, else a hit)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.encoded = False

    def __call__(self) -> Family:
        self.encoded = True
        return model_cache().get(self.spec, "encode")


def card_encoder(job: Job) -> CardEncoder | None:
    """The job's model's text encoders when it encodes on its card, else None (the encode worker's path)."""
    spec = deployment.registry().get(job.model)
    return CardEncoder(spec) if spec.encode_on_card else None


def preload(job_id: str, stage: str, model: str = "") -> bool:
    """Load the job's model (the components of `stage`; a denoise of a model that encodes on its card, its
    text encoders too) before taking its lease: a slow load must not look like a dead worker. `model`: the
    job's model as its message names it (read from the job without one, or when the registry no longer has it).

    False when there is no such job (a message for a deleted job; with `model` given, the claim finds that)."""
    from genserver.jobs.selectors import model_of

    registry = deployment.registry()
    name = model if model in registry else model_of(job_id)
    if name is None:
        return False
    spec = registry.get(name)
    model_cache().get(spec, stage)
    if stage == "denoise" and spec.encode_on_card:
        model_cache().get(spec, "encode")
    return True


def _warm_up_compiled_models() -> None:
    """Compile and run once the denoisers of `compile = true` entries (workers/runtime/speed.py) in the
    process that will run the jobs, before this worker takes one."""
    from workers.runtime.speed import warm_up_worker

    warm_up_worker(deployment.registry(), lambda spec: model_cache().get(spec, "denoise"))


def denoise_queues() -> list[str]:
    """The denoise queues this worker consumes, as its launcher set them (none: not a denoise worker, or a bare
    worker the launcher did not start)."""
    return [queue for queue in config.worker_queues() if class_of(queue) in CLASSES]


def _subscribe_to_flags() -> None:
    """A worker that runs denoise chunks subscribes to the cancel and new-total announcements before its first
    job (genserver/jobs/flags.py), so that job's steps check them without reading Redis either."""
    if denoise_queues():
        flags.watch().subscribe()


@worker_init.connect
def warm_up_in_main_process(**kwargs) -> None:
    if config.worker_pool() in ("solo", "threads"):  # tasks run in this process
        events.publish_in_background()
        _warm_up_compiled_models()
        _subscribe_to_flags()


@worker_process_init.connect
def warm_up_in_pool_process(**kwargs) -> None:
    events.publish_in_background()  # prefork: each child runs jobs
    _warm_up_compiled_models()
    _subscribe_to_flags()


@worker_shutdown.connect
@worker_process_shutdown.connect
def release_held_work(**kwargs) -> None:
    """A worker that stops between a yield and its next task: the work its card held through the hand-over
    (events.card_handing_over) goes to its threads now, which finish it before the process exits."""
    events.card_stepping()


storage = default_storage

RENEW_EVERY_SECONDS = 1.0


@contextmanager
def renewing(renew: Callable[[], bool]) -> Iterator[None]:
    """Renew a lease every second while a stage runs outside the step loop (a decode, an assembly):
    a long VAE decode must not look like a dead worker. Stops when `renew` says the lease is lost."""
    stop = threading.Event()

    def loop() -> None:
        from django.db import connection

        try:
            while not stop.wait(RENEW_EVERY_SECONDS):
                if not renew():
                    return
        finally:
            connection.close()

    thread = threading.Thread(target=loop, name="lease-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@task_prerun.connect
@task_postrun.connect
def keep_or_close_the_connection(task=None, **kwargs) -> None:
    """A task's database connection lives DATABASE_CONN_MAX_AGE, as a request's does (Django's rule): kept between
    tasks unless it broke or aged out. Celery's fixup would close it around every task (settings:
    CELERY_DB_REUSE_MAX)."""
    if task is None or not task.request.is_eager:  # an eager task runs inside its caller's transaction
        close_old_connections()
