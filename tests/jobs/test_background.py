"""A worker's background threads (job events, the work off a chunk boundary) wait while its card is on its way to
a step (events.card_busy), so that they do not take the interpreter from a dispatch; never longer than
CARD_BUSY_MAX_SECONDS after they were queued. In a worker, work handed over meanwhile is held in the process, so that
its thread is not even woken (events.hold_hand_overs_while_busy)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from genserver.jobs import events


class CountingExecutor(ThreadPoolExecutor):
    """A one-thread executor that counts the items queued on it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.queued = 0

    def submit(self, fn, /, *args, **kwargs):
        self.queued += 1
        return super().submit(fn, *args, **kwargs)


@pytest.fixture
def executor():
    pool = CountingExecutor()
    yield pool
    events.card_stepping()
    pool.shutdown(wait=True)


@pytest.fixture
def holding(monkeypatch):
    """This process holds what is handed over while its card is busy, as a worker does (its own watcher, ended
    after the test)."""
    monkeypatch.setattr(events, "_watcher", None)
    events.hold_hand_overs_while_busy()
    yield
    events.card_stepping()


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


def test_work_handed_over_while_the_card_is_busy_is_held_until_it_steps_and_keeps_its_order(
    executor, holding, monkeypatch
):
    monkeypatch.setattr(events, "CARD_BUSY_MAX_SECONDS", 60.0)
    seen = []
    events.after_the_card(executor, seen.append, "before")  # the card is free: queued at once
    events.card_busy()
    first = events.after_the_card(executor, lambda: seen.append(events._card_free.is_set()))
    events.after_the_card(executor, seen.append, "second")
    assert executor.queued == 1  # its thread was not woken for either
    events.card_stepping()
    after = events.after_the_card(executor, seen.append, "after")
    first.result(timeout=30)
    after.result(timeout=30)
    assert executor.queued == 4
    assert seen == ["before", True, "second", "after"]


def test_held_work_runs_at_the_latest_after_the_bound_while_the_card_stays_busy(executor, holding, monkeypatch):
    monkeypatch.setattr(events, "CARD_BUSY_MAX_SECONDS", 0.05)
    monkeypatch.setattr(events, "HELD_CHECK_SECONDS", 0.01)
    seen = []
    events.card_busy()
    events.after_the_card(executor, seen.append, "first").result(timeout=30)
    events.after_the_card(executor, seen.append, "second").result(timeout=30)
    assert seen == ["first", "second"] and not events._card_free.is_set()  # the watcher queued them


def test_a_hand_over_keeps_background_work_waiting_until_the_next_task_steps(executor, holding, monkeypatch):
    """A card that yielded to a waiting message is still on its way to a step: the yielded chunk's deferred work
    waits through Celery's ack and delivery and the next task's claim, and runs once that task steps."""
    monkeypatch.setattr(events, "CARD_BUSY_MAX_SECONDS", 60.0)
    monkeypatch.setattr(events, "HAND_OVER_MAX_SECONDS", 60.0)
    seen = []
    events.card_busy()  # the yielding chunk's boundary
    deferred = events.after_the_card(executor, seen.append, "the yielded chunk's")
    events.card_handing_over()  # its task ends
    events.card_busy()  # the next task starts, claims, loads
    assert executor.queued == 0 and seen == []
    events.card_stepping()  # its first step
    deferred.result(timeout=30)
    assert seen == ["the yielded chunk's"]


def test_a_hand_over_that_finds_no_task_lets_background_work_go_after_its_bound(executor, holding, monkeypatch):
    monkeypatch.setattr(events, "CARD_BUSY_MAX_SECONDS", 60.0)
    monkeypatch.setattr(events, "HAND_OVER_MAX_SECONDS", 0.05)
    monkeypatch.setattr(events, "HELD_CHECK_SECONDS", 0.01)
    seen = []
    events.card_busy()
    deferred = events.after_the_card(executor, seen.append, "held")
    events.card_handing_over()  # the waiting message went to another card: this one stays idle
    deferred.result(timeout=30)
    events.after_the_card(executor, seen.append, "later").result(timeout=30)
    assert seen == ["held", "later"] and events._card_free.is_set()  # idle again: nothing waits for a step


def test_a_hand_over_in_a_process_that_holds_nothing_lets_work_run_at_once(executor, monkeypatch):
    monkeypatch.setattr(events, "_watcher", None)
    events.card_busy()
    events.card_handing_over()
    assert events._card_free.is_set()
