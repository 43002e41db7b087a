"""Merged work through the whole stack: same-shape jobs waiting together run as one denoise batch.

To make jobs wait together deterministically, the test tells card0 to stop
consuming its queues (Celery's remote control, as an operator would), submits,
waits until every job is encoded and waiting, then gives the queues back.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from genserver.celery import app
from genserver.jobs import flags
from genserver.metrics import merged_counts
from tests.support.api import submit
from tests.support.waits import JOB_SECONDS, finished, job_row, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]


def pixels(api, job_id) -> list[np.ndarray]:
    outputs = api.get(f"/api/v1/jobs/{job_id}/").json()["outputs"]
    return [
        np.asarray(Image.open(io.BytesIO(b"".join(api.get(o["url"]).streaming_content))), dtype=np.int16)
        for o in outputs
    ]


@contextlib.contextmanager
def card_paused(stack, card: str = "card0") -> Iterator[None]:
    """card0 takes no new message inside the block (cancel_consumer / add_consumer)."""

    def card_hostname() -> str | None:
        replies = app.control.ping(timeout=1.0)
        return next((name for reply in replies for name in reply if name.startswith(f"{card}@")), None)

    hostname = wait_for(card_hostname, 30, what=f"{card} to answer a ping")
    queues = [q["name"] for q in app.control.inspect([hostname], timeout=2.0).active_queues()[hostname]]
    for queue in queues:
        app.control.cancel_consumer(queue, destination=[hostname], reply=True, timeout=2.0)
    try:
        yield
    finally:
        for queue in queues:
            app.control.add_consumer(queue, destination=[hostname], reply=True, timeout=2.0)


def waiting(job_ids) -> bool:
    return all((j := job_row(pk)).status == "denoising" and j.stage == "waiting" for pk in job_ids)


def test_merged_jobs_give_the_images_each_gives_alone(stack, api):
    shape = {"model": "tiny-sd", "width": 64, "height": 64, "steps": 8}
    asks = [{"prompt": "a red fox", "seed": 11}, {"prompt": "a blue boat", "seed": 22, "num_outputs": 2}]
    before = merged_counts()
    with card_paused(stack):
        merged = [submit(api, **shape, **ask).json()["id"] for ask in asks]
        wait_for(lambda: waiting(merged), 60, what="both jobs encoded and waiting")
    jobs = [finished(pk) for pk in merged]
    assert [j.status for j in jobs] == ["succeeded", "succeeded"], [j.error for j in jobs]
    after = merged_counts()
    batches = after["batches"] - before["batches"]  # a batch that yields the card merges again when back
    assert batches >= 1 and after["jobs"] - before["jobs"] == 2 * batches
    assert all(j.steps_done == 8 for j in jobs)

    for pk, ask in zip(merged, asks):  # each again, alone: nothing else of its shape waits
        lone = submit(api, **shape, **ask).json()["id"]
        assert finished(lone).status == "succeeded"
        for merged_image, lone_image in zip(pixels(api, pk), pixels(api, lone), strict=True):
            assert np.abs(merged_image - lone_image).max() <= 1  # rounding of float32 sums at most
    assert merged_counts()["batches"] == after["batches"]


def test_cancelling_one_merged_job_leaves_the_others_running(stack, api):
    shape = {"model": "tiny-sd", "width": 128, "height": 128, "steps": 50, "prompt": "a long one"}
    before = merged_counts()
    with card_paused(stack):
        ids = [submit(api, **shape, seed=seed).json()["id"] for seed in (1, 2, 3)]
        wait_for(lambda: waiting(ids), 60, what="three jobs encoded and waiting")
        # The cancel goes in as the batch would meet it right after its claim: the worker's flag (not yet the
        # database's, which would keep the job out of the batch), set before the card takes the three. The claim
        # stands for the flag's read before the first step, so the batch sees it before its second. (Cancelling
        # through the API once the batch was counted lost the race twice on a busy machine: the request landed
        # after all 50 steps. That the API's cancel of a held job sets this flag, and a lone running job stops at
        # it, test_stack.py shows.)
        flags.raise_cancel(ids[1])
    cancelled = finished(ids[1], timeout=JOB_SECONDS)
    assert cancelled.status == "cancelled" and not cancelled.outputs
    assert cancelled.steps_done <= 1  # it left the batch after its first step, at the flag's first read
    others = [finished(pk) for pk in (ids[0], ids[2])]
    assert [j.status for j in others] == ["succeeded", "succeeded"], [j.error for j in others]
    assert all(j.steps_done == 50 and len(j.outputs) == 1 for j in others)
    assert merged_counts()["jobs"] - before["jobs"] >= 3  # the cancelled job was one of the batch


def test_simulated_few_step_jobs_merge_and_a_large_model_does_not(stack, api, staff_api):
    before = merged_counts()
    with card_paused(stack):
        turbo = [submit(api, model="sdxl-turbo-sim", prompt=f"draft {i}", seed=i).json()["id"] for i in range(4)]
        large = [submit(api, model="sdxl-sim", prompt=f"large {i}", seed=i, steps=4).json()["id"] for i in range(2)]
        wait_for(lambda: waiting(turbo + large), 60, what="six jobs encoded and waiting")
    jobs = [finished(pk) for pk in turbo + large]
    assert all(j.status == "succeeded" for j in jobs), [j.error for j in jobs]
    after = merged_counts()
    # The four drafts share one batch (max_merge 8); sdxl-sim has max_merge 1: its two run alone.
    # (A batch that yields the card at a chunk boundary merges again when it comes back.)
    batches = after["batches"] - before["batches"]
    assert batches >= 1 and after["jobs"] - before["jobs"] == 4 * batches
    assert staff_api.get("/api/v1/workers/").json()["merged_denoise"] == after
