"""The denoise task's cancel check, run here as a worker runs it (real storage, database and Redis; its messages
captured): the claim's compare-and-set stands for the flags' read before a claimed chunk's first step, and a
cancel that lands after the claim still stops the job before its next step."""

from __future__ import annotations

import pytest

from genserver.jobs import services
from genserver.jobs.models import Job, JobStatus
from tests.support.broker import capture_sends
from tests.tasks.test_denoise_boundary import job_with_one_step_chunks

pytestmark = pytest.mark.django_db(transaction=True)


def spy_on_flag_reads(monkeypatch) -> list[tuple[str, int]]:
    """(job id, steps done) at each read of a job's cancel and total flags in Redis."""
    from tasks import denoise

    reads: list[tuple[str, int]] = []
    read = denoise._flagged

    def reading(member):
        reads.append((str(member.job.pk), member.state.step))
        return read(member)

    monkeypatch.setattr(denoise, "_flagged", reading)
    return reads


def test_a_claimed_chunk_reads_the_flags_before_every_step_but_its_first(make_user, monkeypatch):
    from tasks import denoise

    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    reads = spy_on_flag_reads(monkeypatch)
    job = job_with_one_step_chunks(make_user("flags").user, 3)
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "step 3"  # all three chunks kept on this card
    # Step 0 was checked by the claim; the kept chunks' steps 1 and 2 were claimed by nothing, so Redis is read.
    assert reads == [(str(job.pk), 1), (str(job.pk), 2)]


def test_a_cancel_after_the_claim_stops_the_job_after_one_step(make_user, monkeypatch):
    from tasks import denoise

    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    reads = spy_on_flag_reads(monkeypatch)
    job = job_with_one_step_chunks(make_user("late-cancel").user, 3)
    Job.objects.filter(pk=job.pk).update(chunk_steps=3)  # one chunk: only the step check can stop it early
    claim = services.claim_chunk

    def claim_then_cancel(job_id, worker, from_step):
        claimed = claim(job_id, worker, from_step)
        services.cancel_job(Job.objects.get(pk=job_id))  # the owner's cancel lands just after the claim
        return claimed

    monkeypatch.setattr(denoise.services, "claim_chunk", claim_then_cancel)
    ran = []
    run = denoise.stages.run_merged_chunk

    def running(*args, **kwargs):
        results = run(*args, **kwargs)
        ran.extend((r.step, r.stopped) for r in results)
        return results

    monkeypatch.setattr(denoise.stages, "run_merged_chunk", running)
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "cancelled"
    assert ran == [(1, "cancelled")]  # step 0 ran, step 1 did not
    assert reads == [(str(job.pk), 1)]
    assert Job.objects.get(pk=job.pk).status == JobStatus.CANCELLED


def test_after_its_first_read_a_chunk_reads_the_flags_from_redis_only_when_announced(make_user, monkeypatch):
    """The check before each step drains the card's subscription (genserver/jobs/flags.py); Redis is read once,
    before the second step, and again only for the job's announced cancel, which stops it at that step."""
    from genserver.jobs import flags
    from tasks import denoise

    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    watch = flags.watch()  # this thread's, which the task run here uses
    assert watch.subscribe(timeout=10)
    monkeypatch.setattr(watch, "recheck_seconds", 3600.0)  # no periodic read in this test, however slow the run
    reads = spy_on_flag_reads(monkeypatch)
    job = job_with_one_step_chunks(make_user("announced").user, 6)
    before = watch.reads
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "step 6"
    assert [step for _, step in reads] == [1, 2, 3, 4, 5] and watch.reads - before == 1

    job = job_with_one_step_chunks(make_user("announced-cancel").user, 6)
    checks = denoise._flagged

    def cancelled_after_the_third_check(member):
        found = checks(member)
        if member.state.step == 3:
            flags.raise_cancel(member.job.pk)  # as the API's cancel flags it, while step 3 would run
        return found

    monkeypatch.setattr(denoise, "_flagged", cancelled_after_the_third_check)
    before = watch.reads
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "cancelled"
    assert watch.reads - before == 2  # its first read, then the announced one
    row = Job.objects.get(pk=job.pk)
    assert row.status == JobStatus.CANCELLED and row.steps_done == 4  # steps 0-3 ran; step 4 did not
