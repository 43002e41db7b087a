"""The overload cap on the real stack: two cards, a long backlog, one card gives long work up and takes it back.

The session stack's card and a second launcher's card ("capnode", same
machine, its own node name) both take long work. Two 6-second videos fill
both; the long class's expected wait passes half its limit, beat's tick
engages the cap, and at its next chunk boundary one card hands its video back
and stops consuming the long queue (Celery's cancel_consumer, addressed to
it). The other card runs both videos in turn; once the backlog is gone the cap
lets go and the paused card consumes long again (add_consumer from its
heartbeat).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.api import submit
from tests.support.waits import finished, wait_for
from workers.local_workers import LocalWorkers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack, pytest.mark.heavy]

VIDEO = {"model": "wan-sim", "width": 1280, "height": 720, "num_frames": 81}  # 6 s of wall time each


@pytest.fixture
def second_card(stack) -> Iterator[LocalWorkers]:
    node = LocalWorkers(loglevel="WARNING", node="capnode", beat=False)  # the session stack's beat decides
    try:
        yield node
    finally:
        node.stop()


def long_queue(api) -> dict:
    return {q["name"]: q for q in api.get("/api/v1/queues/").json()}["long"]


def consumes_long(worker: str) -> bool:
    from genserver.celery import app

    replies = app.control.inspect(destination=[worker], timeout=2.0).active_queues() or {}
    return any(q["name"] == "long" for q in replies.get(worker, []))


def test_a_long_backlog_caps_long_work_to_one_card_and_lets_go_after(stack, second_card, staff_api):
    from genserver.jobs import selectors

    cards = sorted(n for n in stack.names | second_card.names if n.startswith("card0@"))
    assert len(cards) == 2, cards
    wait_for(lambda: long_queue(staff_api)["cards"] == 2, 60, what="both cards live for the long class")
    assert long_queue(staff_api)["capped"] is False

    ids = []
    for i in range(2):
        response = submit(staff_api, **VIDEO, prompt=f"video {i}")
        assert response.status_code == 201, response.content
        ids.append(response.json()["id"])

    # Both run; the wait of a new long job passes half the limit; beat engages the cap.
    wait_for(lambda: long_queue(staff_api)["capped"], 60, interval=0.2, what="the cap to engage")
    assert long_queue(staff_api)["cards"] == 1
    # One card gives long work up: a video waits with its steps begun while the other runs, and that
    # card no longer consumes the long queue.
    wait_for(
        lambda: selectors.cards_running_long() <= 1 and not all(consumes_long(c) for c in cards),
        60,
        interval=0.2,
        what="one card to give long work up",
    )
    jobs = [finished(i, timeout=120) for i in ids]
    assert [j.status for j in jobs] == ["succeeded", "succeeded"], [(j.status, j.error) for j in jobs]

    # The backlog gone: the cap lets go and both cards consume long again.
    wait_for(lambda: not long_queue(staff_api)["capped"], 60, interval=0.2, what="the cap to let go")
    wait_for(lambda: all(consumes_long(c) for c in cards), 60, interval=0.5, what="both cards back on long work")
    assert long_queue(staff_api)["cards"] == 2
