"""A worker's background threads (job events, the work off a chunk boundary) wait while its card is on its way to
a step (events.card_busy), so that they do not take the interpreter from a dispatch; never longer than
CARD_BUSY_MAX_SECONDS after they were queued."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from genserver.jobs import events


@pytest.fixture
def executor():
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    events.card_stepping()
    pool.shutdown(wait=True)


def test_background_work_waits_while_the_card_is_busy_and_runs_once_it_steps(executor, monkeypatch):
    monkeypatch.setattr(events, "CARD_BUSY_MAX_SECONDS", 60.0)
    seen = []
    events.card_busy()
    done = events.after_the_card(executor, lambda: seen.append(events._card_free.is_set()))
    events.after_the_card(executor, seen.append, "second")
    events.card_stepping()
    done.result(timeout=30)
    executor.submit(lambda: None).result(timeout=30)
    assert seen == [True, "second"]  # neither ran while the card was busy; both in order once it stepped


def test_background_work_runs_at_the_latest_after_the_bound_while_the_card_stays_busy(executor, monkeypatch):
    monkeypatch.setattr(events, "CARD_BUSY_MAX_SECONDS", 0.05)
    seen = []
    events.card_busy()
    events.after_the_card(executor, seen.append, "first").result(timeout=30)
    events.after_the_card(executor, seen.append, "second").result(timeout=30)
    assert seen == ["first", "second"] and not events._card_free.is_set()  # a model load does not hold events


def test_a_failure_in_background_work_is_logged(executor, caplog):
    def broken() -> None:
        raise RuntimeError("redis went away")

    events.after_the_card(executor, broken).result(timeout=30)
    assert "background work broken" in caplog.text and "redis went away" in caplog.text
