"""The overload cap's check at a chunk's start reads nothing for a chunk delivered from a queue that is not long
(the queue is in the message's delivery info); a long one still reads the cap's state."""

from __future__ import annotations

from types import SimpleNamespace

from tasks import denoise


def delivered_from(queue: str | None) -> SimpleNamespace:
    info = {"routing_key": queue} if queue else {}
    return SimpleNamespace(request=SimpleNamespace(delivery_info=info))


def test_a_chunk_from_a_short_queue_is_never_held_back_and_reads_nothing(monkeypatch):
    def must_not_read():
        raise AssertionError("the cap's state was read for a chunk that is not long")

    monkeypatch.setattr(denoise.selectors, "long_cap_state", must_not_read)
    for queue in ("short", "medium", "short.sdxl", "short@interactive"):
        assert not denoise._held_back_by_the_long_cap(delivered_from(queue), "job", 0, "card0@test:1")


def test_a_long_chunk_or_one_without_delivery_info_reads_the_cap(monkeypatch):
    reads = []
    monkeypatch.setattr(denoise.selectors, "long_cap_state", lambda: reads.append(1) or SimpleNamespace(engaged=False))
    for queue in ("long", "long.wan", None):  # None: a task run directly (apply), not from the broker
        assert not denoise._held_back_by_the_long_cap(delivered_from(queue), "job", 0, "card0@test:1")
    assert len(reads) == 3
