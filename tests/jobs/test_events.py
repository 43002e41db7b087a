"""The job event stream: GET /api/v1/jobs/{id}/events/ served by the real ASGI server, fed by the job service.

The stream tests run uvicorn (tests/support/live_server.py) and the real
workers (`stack`), and read the stream over HTTP as a client does.
"""

from __future__ import annotations

import json

import pytest
import requests

from genserver.jobs import events
from tests.support.waits import finished, wait_for


def read_events(response: requests.Response) -> list[dict]:
    """Parse a text/event-stream body into [{id, data (parsed), ...}] until the server closes it."""
    found, current = [], {}
    for raw in response.iter_lines(decode_unicode=True):
        if raw == "":
            if "data" in current:
                current["data"] = json.loads(current["data"])
                found.append(current)
            current = {}
            continue
        if raw.startswith(":"):
            continue
        field, _, value = raw.partition(":")
        current[field] = value[1:] if value.startswith(" ") else value
    return found


def open_stream(server, token: str, job_id: str, last_event_id: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Token {token}", "Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    return requests.get(f"{server.url}/api/v1/jobs/{job_id}/events/", headers=headers, stream=True, timeout=120)


def post_job(server, token: str, **fields) -> dict:
    body = {"model": "sdxl-sim", "prompt": "a lighthouse at dusk", "steps": 30, "preview_every": 5} | fields
    response = requests.post(
        f"{server.url}/api/v1/jobs/", json=body, headers={"Authorization": f"Token {token}"}, timeout=60
    )
    assert response.status_code == 201, response.text
    return response.json()


@pytest.mark.stack
def test_a_stream_follows_the_job_to_its_end(stack, asgi_server, api_token):
    token = api_token("streamer")
    job = post_job(asgi_server, token)
    response = open_stream(asgi_server, token, job["id"])
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    received = read_events(response)  # returns only when the server ends the stream

    detail = requests.get(
        f"{asgi_server.url}/api/v1/jobs/{job['id']}/", headers={"Authorization": f"Token {token}"}, timeout=30
    ).json()
    assert received[-1]["data"]["status"] == "succeeded"
    assert received[-1]["data"] == detail  # the same representation as GET /jobs/{id}/, absolute URLs included
    assert all(set(e["data"]) == set(detail) for e in received)
    ids = [tuple(map(int, e["id"].split("-"))) for e in received]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    statuses = [e["data"]["status"] for e in received]
    assert "decoding" in statuses or "denoising" in statuses
    steps = [e["data"]["progress"]["step"] for e in received]
    assert steps == sorted(steps) and steps[-1] == 30
    assert any(e["data"]["preview_url"] for e in received)


@pytest.mark.stack
def test_a_reconnect_resumes_after_last_event_id_and_gets_the_terminal_event(stack, asgi_server, api_token):
    token = api_token("reconnector")
    job = post_job(asgi_server, token)
    everything = read_events(open_stream(asgi_server, token, job["id"]))
    assert everything[-1]["data"]["status"] == "succeeded"
    log = events.log_key(job["id"])
    from genserver.redis_client import client

    logged = [entry_id.decode() for entry_id, _ in client().xrange(log)]
    assert logged, "the job service wrote no event log"
    assert len(logged) >= 3
    # A client that saw the log's first entry and lost its connection gets the rest, the end included.
    resumed = read_events(open_stream(asgi_server, token, job["id"], last_event_id=logged[0]))
    assert [e["id"] for e in resumed] == logged[1:]
    assert resumed[-1]["data"]["status"] == "succeeded"
    # One that has the terminal event is told to stop reconnecting.
    assert open_stream(asgi_server, token, job["id"], last_event_id=logged[-1]).status_code == 204


@pytest.mark.stack
def test_only_the_owner_and_staff_see_the_stream(stack, asgi_server, api_token):
    owner, other, staff = api_token("owner-e"), api_token("other-e"), api_token("staff-e", staff=True)
    job = post_job(asgi_server, owner, steps=4, preview_every=0)
    finished(job["id"])
    assert open_stream(asgi_server, other, job["id"]).status_code == 404
    response = requests.get(f"{asgi_server.url}/api/v1/jobs/{job['id']}/events/", timeout=30)
    assert response.status_code == 401
    assert open_stream(asgi_server, "not-a-token", job["id"]).status_code == 401
    ended = read_events(open_stream(asgi_server, staff, job["id"]))
    assert len(ended) == 1 and ended[0]["data"]["status"] == "succeeded"  # a finished job: its end, at once


@pytest.mark.stack
def test_a_cancelled_job_ends_its_stream(stack, asgi_server, api_token):
    token = api_token("canceller-e")
    job = post_job(asgi_server, token, model="wan-sim", width=832, height=480, num_frames=81, steps=50, preview_every=0)
    response = open_stream(asgi_server, token, job["id"])
    cancel = requests.post(
        f"{asgi_server.url}/api/v1/jobs/{job['id']}/cancel/", headers={"Authorization": f"Token {token}"}, timeout=30
    )
    assert cancel.status_code == 202
    received = read_events(response)
    assert received[-1]["data"]["status"] == "cancelled"


# --- the publisher (no workers: the job service's calls, made here) ------------------------------


@pytest.mark.django_db
def test_publish_appends_the_api_representation_and_announces_it(api, redis_conn):
    from tests.support.api import submit

    job_id = submit(api, steps=10).json()["id"]
    pubsub = redis_conn.pubsub()
    pubsub.subscribe(events.channel(job_id))
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    entry_id = events.publish(job_id, "progress")
    assert entry_id
    note = pubsub.get_message(timeout=5)
    assert note and note["data"].decode() == entry_id
    [(logged_id, fields)] = redis_conn.xrange(events.log_key(job_id))
    assert logged_id.decode() == entry_id and fields[b"event"] == b"progress" and fields[b"terminal"] == b"0"
    body = json.loads(fields[b"job"])
    assert body["id"] == job_id and body["status"] == "queued" and "queue_position" in body and "eta_seconds" in body
    assert 0 < redis_conn.ttl(events.log_key(job_id)) <= 3600
    api.post(f"/api/v1/jobs/{job_id}/cancel/")  # ends it at once (no worker holds it): the terminal event
    entries = redis_conn.xrange(events.log_key(job_id))
    assert entries[-1][1][b"event"] == b"cancelled" and entries[-1][1][b"terminal"] == b"1"
    pubsub.close()


@pytest.mark.django_db
def test_a_queue_move_refreshes_only_the_watched_waiting_jobs(api, redis_conn):
    from tests.support.api import submit

    watched, unwatched = (submit(api, steps=10).json()["id"] for _ in range(2))
    from genserver.jobs.models import Job

    queue = Job.objects.get(pk=watched).queue
    pubsub = redis_conn.pubsub()
    pubsub.subscribe(events.channel(watched))
    pubsub.get_message(timeout=1)
    assert events.publish_queue_moved(queue) == 1
    assert redis_conn.xlen(events.log_key(watched)) == 1
    assert redis_conn.exists(events.log_key(unwatched)) == 0
    pubsub.close()


def another_publisher_holds_the_lock(job_id: str, redis_conn, monkeypatch):
    """(another process's hold on the job's publish lock, between its render and its append; an event set once
    this process tries to take the lock)."""
    import threading

    other = redis_conn.lock(events.PUBLISH_LOCK.format(job_id=job_id), timeout=30)
    assert other.acquire()
    trying = threading.Event()
    real_lock = redis_conn.lock

    def watched_lock(name, **kwargs):
        lock = real_lock(name, **kwargs)
        acquire = lock.acquire
        lock.acquire = lambda *a, **k: trying.set() or acquire(*a, **k)
        return lock

    monkeypatch.setattr(redis_conn, "lock", watched_lock)
    monkeypatch.setattr(events, "redis_client", lambda: redis_conn)
    return other, trying


@pytest.mark.django_db(transaction=True)  # the publisher runs in a thread of its own
def test_a_publisher_waits_for_another_publishing_the_same_job(api, redis_conn, monkeypatch):
    """Several processes publish one job's events (its encode worker, each card a chunk runs on): each renders the
    row and appends it under the job's lock, so an older picture is never appended after a newer one (a stream
    that saw step 5, then step 1)."""
    import threading

    from tests.support.api import submit

    job_id = submit(api, steps=10).json()["id"]
    other, trying = another_publisher_holds_the_lock(job_id, redis_conn, monkeypatch)
    publisher = threading.Thread(target=events.publish, args=(job_id, "progress"))
    publisher.start()
    assert trying.wait(30)
    redis_conn.xadd(events.log_key(job_id), {"event": "theirs"})  # the other's append, while it holds the lock
    other.release()
    publisher.join(30)
    logged = [fields[b"event"] for _, fields in redis_conn.xrange(events.log_key(job_id))]
    assert logged == [b"theirs", b"progress"]
    assert not redis_conn.exists(events.PUBLISH_LOCK.format(job_id=job_id))  # released once appended


@pytest.mark.django_db(transaction=True)  # the snapshot runs in a thread of its own
def test_a_new_streams_snapshot_waits_for_a_publisher_between_its_render_and_its_append(api, redis_conn, monkeypatch):
    """A new stream's first frame (the job now, and the log's newest id) is taken under the job's lock: an event
    another process rendered before it and logs after it is in the snapshot's log position, not after it."""
    import threading

    from tests.support.api import submit

    job_id = submit(api, steps=10).json()["id"]
    other, trying = another_publisher_holds_the_lock(job_id, redis_conn, monkeypatch)
    taken: list = []
    reader = threading.Thread(target=lambda: taken.append(events.snapshot(job_id, lambda: "the job now")))
    reader.start()
    assert trying.wait(30)
    theirs = redis_conn.xadd(events.log_key(job_id), {"event": "theirs"}).decode()  # rendered before, logged now
    other.release()
    reader.join(30)
    assert taken == [(theirs, "the job now")]  # the stream replays from after it: nothing older comes later


@pytest.mark.django_db
def test_nothing_is_logged_after_a_jobs_end_but_a_new_end(api, redis_conn):
    """A publisher whose transition came before the end renders the ended job: it adds no second end. A job taken
    up again (an admin's retry) logs as before."""
    from genserver.jobs.models import Job, JobStatus
    from tests.support.api import submit

    job_id = submit(api, steps=10).json()["id"]
    api.post(f"/api/v1/jobs/{job_id}/cancel/")  # ends it at once: the terminal event
    ended = redis_conn.xrange(events.log_key(job_id))
    assert ended[-1][1][b"terminal"] == b"1"
    assert events.publish(job_id, "decoding") == ended[-1][0].decode()  # late: rendered as cancelled
    assert events.publish(job_id, "cancelled") == ended[-1][0].decode()
    assert redis_conn.xrange(events.log_key(job_id)) == ended
    Job.objects.filter(pk=job_id).update(status=JobStatus.QUEUED)  # taken up again
    events.publish(job_id, "queued")
    assert redis_conn.xrange(events.log_key(job_id))[-1][1][b"event"] == b"queued"


# --- the hub: one subscription and one read per entry for every stream of a process ------------------


@pytest.mark.django_db(transaction=True)  # the publisher runs in a thread of its own, outside the event loop
def test_the_streams_of_a_process_share_one_read_and_one_frame_per_entry(api, redis_conn):
    """Three streams follow one job through the process's hub: each entry is read from Redis once
    and framed once (per base URL), and every stream gets those same bytes; the last one to
    leave unsubscribes the hub from the job's channel."""
    import asyncio

    from asgiref.sync import sync_to_async

    from genserver.jobs.api import events as view
    from tests.support.api import submit

    job_id = submit(api, steps=10).json()["id"]

    async def scenario() -> None:
        hub = view._hub()
        reads = []
        xrange = hub.conn.xrange

        async def counted(*args, **kwargs):
            reads.append(args)
            return await xrange(*args, **kwargs)

        hub.conn.xrange = counted
        wakers = [await hub.follow(job_id) for _ in range(3)]
        assert redis_conn.pubsub_numsub(events.channel(job_id))[0][1] == 1, "one subscription for all three"
        first = await sync_to_async(events.publish)(job_id, "progress")
        assert first
        await asyncio.wait_for(asyncio.gather(*(w.wait() for w in wakers)), 10)
        got = await asyncio.gather(*(hub.after(job_id, "0-0") for _ in wakers))
        assert [[e.id for e in entries] for entries in got] == [[first]] * 3
        assert len(reads) == 1, "the three streams' reads were one XRANGE"
        frames = {id(entries[0].frame("http://testserver")) for entries in got}
        assert len(frames) == 1, "one frame, the same bytes, for every stream"
        body = json.loads(got[0][0].frame("http://testserver").split(b"data: ", 1)[1])
        assert body["id"] == job_id and body["status"] == "queued"
        assert await hub.after(job_id, first) == [] and len(reads) == 1, "nothing new: no read"
        for woken in wakers:
            await hub.unfollow(job_id, woken)
        unwatched = lambda: redis_conn.pubsub_numsub(events.channel(job_id))[0][1] == 0  # noqa: E731
        wait_for(unwatched, 10, what="the hub to unsubscribe from the job's channel")
        hub.runner.cancel()
        await hub.pubsub.aclose()

    asyncio.run(scenario())
