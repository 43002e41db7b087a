"""A card at a chunk boundary yields to better work waiting (broker.should_yield), and holds for a better job whose
encode is under way, so that an image arriving while every card is mid-video waits for its encode, not for a
video's next step (real Redis and the real broker; the database of the API's submit)."""

from __future__ import annotations

import threading
import time
from uuid import uuid4

import pytest

from genserver.jobs import broker, services
from genserver.jobs.models import Job
from genserver.redis_client import ARRIVING_CLAIM_KEY, ARRIVING_KEY, client as redis_client
from tests.conftest import submit
from tests.support.broker import clear_broker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("empty_broker")]

HOLD = 30.0  # long enough for any machine: every test ends its hold by an event, never by the deadline


def announced(queue: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in redis_client().hgetall(ARRIVING_KEY.format(queue=queue)).items()}


def test_an_encode_announces_the_first_chunk_until_the_chunk_is_published(api):
    job = Job.objects.get(pk=submit(api, prompt="a new prompt: its embeddings are not stored").json()["id"])
    priority, since = announced(job.queue)[str(job.pk)].split()
    assert int(priority) == job.priority and float(since) <= time.time()
    assert services.start_encoding(job.pk, "encode@test") is not None
    assert services.finish_encoding(job.pk, "encode@test", f"embeddings/{job.pk}")
    assert str(job.pk) not in announced(job.queue)  # its chunk waits now: the announcement is withdrawn
    assert broker.should_yield([job.queue], job.priority, "card0@test", hold=0.0)  # it waits


def _announce(queue: str, priority: int, ago: float = 0.0) -> str:
    job_id = str(uuid4())
    redis_client().hset(ARRIVING_KEY.format(queue=queue), job_id, f"{priority} {time.time() - ago}")
    return job_id


def _publish_soon(job_id: str, queue: str, priority: int, then_take: bool = False) -> threading.Thread:
    """What the encode does once a card holds for the job: the first chunk published, the announcement
    withdrawn; with `then_take`, another card takes the message before the holding card sees it."""

    def publish() -> None:
        claim = ARRIVING_CLAIM_KEY.format(job_id=job_id)
        deadline = time.monotonic() + HOLD
        while not redis_client().exists(claim) and time.monotonic() < deadline:
            time.sleep(0.001)  # a condition: the card claimed the job and holds for it
        if then_take:
            broker.arrived(job_id, queue)
            return
        broker.send_chunk(job_id, 0, queue, priority)
        broker.arrived(job_id, queue)

    thread = threading.Thread(target=publish)
    thread.start()
    return thread


def test_one_card_holds_for_a_better_announced_job_and_yields_once_its_chunk_is_published():
    job_id = _announce("short", priority=1)
    assert not broker.should_yield(["short", "long"], 6, "card9@test", hold=0.0)  # nothing waits yet
    thread = _publish_soon(job_id, "short", 1)
    assert broker.should_yield(["short", "long"], 6, "card0@test", HOLD)  # held until it was published
    thread.join()
    assert broker.should_yield(["short", "long"], 6, "card1@test", HOLD)  # its chunk waits: any card yields
    clear_broker()  # card0 took it
    # A job another card holds for: this one keeps its own.
    other = _announce("short", priority=1)
    redis_client().set(ARRIVING_CLAIM_KEY.format(job_id=other), "card0@test")
    assert not broker.should_yield(["short", "long"], 6, "card1@test", HOLD)


def test_a_hold_ends_when_another_card_took_the_announced_job():
    job_id = _announce("short", priority=1)
    thread = _publish_soon(job_id, "short", 1, then_take=True)
    assert not broker.should_yield(["short", "long"], 6, "card0@test", HOLD)  # the card keeps its job
    thread.join()


def test_no_hold_for_work_that_is_not_better_stale_or_on_another_queue_or_when_off():
    _announce("long", priority=6)  # the continuation's own priority: published after it, so behind it
    _announce("medium", priority=1)  # a queue this card does not consume
    stale = _announce("short", priority=1, ago=HOLD + 1)  # its encode failed or it was cancelled
    assert not broker.should_yield(["short", "long"], 6, "card0@test", HOLD)
    assert stale not in announced("short")  # forgotten
    _announce("short", priority=1)
    assert not broker.should_yield(["short", "long"], 6, "card0@test", 0.0)  # GENSERVER_BOUNDARY_HOLD=0: off


def test_a_started_video_yields_to_better_work_and_not_to_another_started_video():
    broker.send_chunk(str(uuid4()), 7, "long", 6)  # another video's continuation, at this one's priority
    assert broker.should_yield(["short", "long"], 6, "card0@test", 0.0)  # first come, first served (the short class)
    assert not broker.should_yield(["short", "long"], 6, "card0@test", 0.0, at_equal=False)  # a swap: no
    broker.send_chunk(str(uuid4()), 0, "short", 2)  # an image
    assert broker.should_yield(["short", "long"], 6, "card0@test", 0.0, at_equal=False)
    assert not broker.should_yield(["long"], 6, "card0@test", 0.0, at_equal=False)  # a card that takes no images
    assert not broker.should_yield(["short"], 0, "card0@test", 0.0, at_equal=False)  # nothing is better than 0


def test_the_yield_test_reads_again_after_redis_forgot_its_script():
    assert not broker.should_yield(["short", "long"], 6, "card0@test", HOLD)  # its script sent once
    redis_client().script_flush()  # a Redis restarted since
    broker.send_chunk(str(uuid4()), 0, "short", 2)  # an image
    assert broker.should_yield(["short", "long"], 6, "card0@test", HOLD)  # the script sent again
