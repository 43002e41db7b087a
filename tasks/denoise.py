"""Stage 2: denoise chunks (queue = the job's class); publishes the next chunk or the decode.

Inside a chunk, a job published ahead of its user's turn (the lightest user's,
services/fairness.py) that waits for a card ends one other user's chunk at its
next step (`cut_short`: one card per waiting message); the chunk then ends as a
planned one does.

At each chunk boundary the worker yields its card only when it has to: if a
message it would take before this job's continuation is waiting on its queues
(shorter work, or an earlier message at the same priority in the short class,
where new jobs share it; not another started video's, which a swap would only
pay a restore for), or is about to be (a better job in its encode, which
announced its first chunk: the card holds up to GENSERVER_BOUNDARY_HOLD for
it), it re-publishes the continuation and returns to the broker; otherwise it
runs the next chunk in-process from the state in memory, skipping the broker hop
and the checkpoint restore. The order of work is that of re-publishing every
chunk, less the swaps between started jobs of equal priority. A task that yields
ends with its card still on the way to a step, the waiting job's: the work it
deferred stays held until that step (events.card_handing_over). The checkpoint
is still written at every boundary, so a crash loses at most one chunk; with
GENSERVER_CHECKPOINT_EVERY, a boundary where the card keeps the job writes it
(and records the chunk) only once that many seconds of denoising have run
since the last one, and a crash loses up to that much more. A task never runs
past half the visibility timeout.

Where the card keeps the job, the checkpoint is written without its fsync, which
the worker's background thread does while the next chunk runs, before it
deletes the checkpoint that came before (the fsync was 19 ms of a Wan state's
31-ms save on an H200's host). A crash of the worker loses nothing of it (the file is whole in
the page cache the moment it is renamed into place); a power loss of the
machine before the sync may, and the job then resumes from the checkpoint
before (`_resume_state`): one chunk more. The next such boundary waits for that
sync, so there is never more than one. Every other boundary (a yield, a
segment's or the job's end) syncs before it records, as before.

A job's first chunk whose message carries its publisher's copy of the row (the submit's embedding hit, the
encode's finish: genserver/jobs/rows.py) begins its first step from that copy while the claim goes to the
database on a thread of its own; the claim's answer confirms it before the second step (or, for a chunk of one
step, before the boundary records anything). A claim that does not take the job (cancelled, taken, ended) throws
the step away with nothing written; a row changed since the copy (its total) runs again from the claimed row.
The card reads the job's flags first, and claims first if it was cancelled or re-totalled since the publish.
Nothing of the job is written before its claim answers: its start waits for it on the boundary thread. A model
that merges begins so only when nothing else waits on its queue, since the claim takes the batch with it.

Merged work: when the job's model allows it (the registry's `max_merge`), the
task also takes other jobs waiting with the same shape at the same step and
runs them as one batch, one model call per step. Each member keeps its own
lease, progress, previews, checkpoint, cancel and outputs; a member that is
cancelled or loses its lease leaves the batch and the others go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import redis
from celery import shared_task
from celery.worker import state as worker_state
from django.conf import settings
from django.utils import timezone

from genserver import deployment, metrics
from genserver.jobs import broker, events, flags, rows, selectors, services
from genserver.jobs.models import Job
from genserver.jobs.services import Outcome
from genserver.metrics import count_embedding_cache, count_merged_batch
from genserver.redis_client import BOUNDARY, HOP
from genserver.scheduling.classes import LONG, priority_for, yields_to_equal_priority
from genserver.scheduling.fairness import CUT_AFTER_SECONDS
from genserver.scheduling.pools import class_of
from genserver.storage import StorageKeyMissing
from workers import long_cap
from workers.runtime import stages
from workers.runtime.base import DenoiseState

from .common import card_encoder, denoise_queues, family_of, preload, request_of, storage, worker_id
from .segments import SegmentCursor, job_id_of

log = logging.getLogger(__name__)

HEARTBEAT_EVERY_SECONDS = 1.0  # lease renewal + progress write; per step would hammer the DB on fast models
# How often a running chunk asks whether a job published ahead (the lightest user's) waits for a card: more
# often starts that job sooner after a step, less often reads Redis less (one pipelined read each time).
CUT_CHECK_SECONDS = 0.2
# Work a chunk boundary need not wait for (deleting the previous checkpoint, learning what the chunk and the
# boundary took).
_off_the_boundary = ThreadPoolExecutor(max_workers=1, thread_name_prefix="off-the-boundary")
# A first chunk's claim sent while its first step runs (`_claim_beside_the_first_step`): a thread of its own, so
# it waits behind none of the work the boundaries deferred.
_claiming = ThreadPoolExecutor(max_workers=1, thread_name_prefix="first-claim")
# A member whose first step began from the message's copy of its row, and whose claim then found the row changed
# (its total): the task runs it again from the claimed row.
_REFUTED = "refuted"


def _after_the_boundary(work, *args) -> Future[None]:
    """`work(*args)` on the off-the-boundary thread once the card is stepping again (events.after_the_card)."""
    return events.after_the_card(_off_the_boundary, work, *args)


def _wait_behind(pending: Future[None] | None) -> None:
    """Wait for work handed to a background thread; the card lets background work run while it waits (else that
    work would wait for the card in turn, events.CARD_BUSY_MAX_SECONDS). Its error is raised here."""
    if pending is None:
        return
    if not pending.done():
        events.card_stepping()
        try:
            pending.exception()
        finally:
            events.card_busy()
    pending.result()


def _consumed_queues(job_queue: str) -> list[str]:
    """The denoise queues this worker consumes (the launcher sets them; a bare worker assumes the job's)."""
    return denoise_queues() or [job_queue]


@dataclass
class _Member:
    """One job of the batch this task runs, and what the task keeps about it between steps."""

    job: Job
    last_beat: float
    checkpoint_key: str  # the last checkpoint recorded, deleted once the next one is
    state: DenoiseState | None = None
    unsaved_seconds: float = 0.0  # denoising run here since the last checkpoint (kept boundaries that wrote none)
    unsynced: Future[None] | None = None  # the fsync of the last checkpoint written without it, off the boundary
    started: Future[None] | None = None  # the write of its first step's start, beside that step
    outcome: str = ""  # set once the job has left this task
    cursor: SegmentCursor | None = None  # global steps over a long video's segments (one segment otherwise)
    # Every member was claimed by this task's compare-and-set, which found no cancel and read the current total:
    # that check stands for the flags' read before its first step (a cancel after it stops the job at the next).
    flags_read_at_claim: bool = True
    # A first step begun from the message's copy of the row: its claim, on the way (`_confirmed`), then what it
    # found ("" the copy holds; else the member's stop) and the row it returned.
    claim: Future[Job | None] | None = None
    claim_found: str = ""
    claimed: Job | None = None

    def __post_init__(self) -> None:
        self.cursor = SegmentCursor(self.job)
        self.checkpoint_key = self.cursor.deletable(self.job.checkpoint_step, self.checkpoint_key)


# When this card last became free (the end of its last chunk task; the process's start before the first): a first
# chunk whose message was published after it found the card idle, so its wait for the first step was dispatch
# alone, what the ETAs learn as the model's HOP.
_free_since = time.time()
# The running task yields its card to a message waiting for it (the boundary's yield test): at its end the card
# is still on its way to a step, the next task's (events.card_handing_over).
_handing_over = False


@shared_task(name=broker.CHUNK_TASK.name, bind=True)
def run_chunk(self, job_id: str, from_step: int, model: str = "", row: dict | None = None, **later) -> str:
    """`model`: the job's model, when the publisher had the job (broker.send_chunk); else it is read. `row`: a
    first chunk's publisher's copy of the job's row (genserver/jobs/rows.py). `later`: arguments a publisher of a
    later version adds, which this one does without."""
    global _free_since, _handing_over
    free_since, _handing_over = _free_since, False
    events.card_busy()  # to the first step, this process's background threads wait (genserver/jobs/events.py)
    try:
        return _run_chunk(self, job_id, from_step, free_since, model, row)
    finally:
        if _handing_over:
            events.card_handing_over()
        else:
            events.card_stepping()
        _free_since = time.time()


def _run_chunk(task, job_id: str, from_step: int, free_since: float, model: str, row: dict | None) -> str:
    worker = worker_id(task)
    if _held_back_by_the_long_cap(task, job_id, from_step, worker, model):
        return Outcome.SKIPPED
    if not preload(job_id, "denoise", model):
        return Outcome.SKIPPED
    copy = _copy_to_begin_from(job_id, from_step, row)
    if copy is not None:
        lead = _Member(copy, time.monotonic(), copy.checkpoint_key)
        lead.claim = _claim_beside_the_first_step(job_id, worker, from_step)
        outcome = _run_members([lead], worker, free_since, measures_hop=True)
        if outcome != _REFUTED:
            return outcome
        job = lead.claimed  # claimed, but not the job the copy described: run again from the claimed row
    else:
        job = services.claim_chunk(job_id, worker, from_step)
    if job is None:
        return Outcome.SKIPPED  # already past this step, held elsewhere, cancelled or finished
    partners = services.claim_merge_partners(job, worker, deployment.registry().get(job.model).max_merge)
    if partners:
        count_merged_batch(1 + len(partners))
    members = [_Member(j, time.monotonic(), j.checkpoint_key) for j in [job, *partners]]
    # A run again from the claimed row measures no HOP: its first step came after a thrown-away one.
    return _run_members(members, worker, free_since, measures_hop=from_step == 0 and copy is None)


def _run_members(members: list[_Member], worker: str, free_since: float, *, measures_hop: bool) -> str:
    """`_denoise` the members, their cancels watched meanwhile. `measures_hop`: the lead's first chunk, whose
    first step measures the HOP when its message found this card idle."""
    lead = members[0].job
    found_idle = measures_hop and lead.published_at is not None and lead.published_at.timestamp() >= free_since
    watch = flags.watch()
    for m in members:
        watch.track(m.job.pk)  # its first read (before its second step) is Redis's; then only what is announced
    try:
        return _denoise(members, worker, hop_from=lead.published_at.timestamp() if found_idle else None)
    finally:
        for m in members:
            watch.untrack(m.job.pk)


def _copy_to_begin_from(job_id: str, from_step: int, row: dict | None) -> Job | None:
    """The message's copy of the job's row, when the first step may begin from it before the claim returns
    (GENSERVER_FIRST_STEP_BEFORE_CLAIM): a first chunk, the copy whole and of this job, no cancel or new total
    raised for it since (the claim would refuse the step, or run another: a cancelled job's message still comes
    to a card, and a video's step is seconds of it), and no job its claim would merge with it (a model that
    merges: nothing else waits on its queue)."""
    if row is None or from_step != 0 or not settings.FIRST_STEP_BEFORE_CLAIM:
        return None
    copy = rows.job_from_row(row)
    if copy is None or str(copy.pk) != job_id or copy.checkpoint_step != 0 or copy.segment_count != 1:
        return None
    registry = deployment.registry()
    if copy.model not in registry:  # dropped from the registry since: the claim-first path says what to do
        return None
    # The job's first flags read is its watch's (one round trip), so the check before its second step reads no
    # flag again; a flag raised after it is announced there, and the claim finds it too.
    watch = flags.watch()
    watch.track(job_id)
    try:
        if any(watch.current(job_id) or ()):
            copy = None
        elif registry.get(copy.model).max_merge > copy.num_outputs and broker.broker_depth(copy.queue):
            copy = None  # the claim takes its merge partners with it: claim first
    except redis.RedisError:  # the claim-first path needs neither read
        log.warning("could not read job %s's flags or queue; claiming it first", job_id, exc_info=True)
        copy = None
    if copy is None:
        watch.untrack(job_id)  # the claim-first path tracks it again, and reads its flags afresh
    return copy


def _claim_beside_the_first_step(job_id: str, worker: str, from_step: int) -> Future[Job | None]:
    """`services.claim_chunk` on the claiming thread (its own connection) once the card steps
    (`events.after_the_card`): sent earlier, its Python would take the interpreter from the card's way to the
    step, each time that let it go. The future carries the claim's row, or its error."""
    claimed: Future[Job | None] = Future()

    def claim() -> None:
        try:
            claimed.set_result(services.claim_chunk(job_id, worker, from_step))
        except Exception as error:  # noqa: BLE001 - the card's next check raises it (`_confirmed`)
            claimed.set_exception(error)

    def never_ran(run: Future[None]) -> None:  # its connection could not be made ready
        if not claimed.done() and run.exception() is not None:
            claimed.set_exception(run.exception())

    events.after_the_card(_claiming, claim).add_done_callback(never_ran)
    return claimed


def _confirmed(member: _Member) -> str:
    """ "" when the member's row is claimed (its claim answered: the copy it began from becomes the claimed row);
    else why it stops: SKIPPED (the claim found the job cancelled, taken or ended) or _REFUTED (the row is not
    the copy: its step must be run again). The claim's error is raised here, as the claim's own would be."""
    pending, member.claim = member.claim, None
    if pending is not None:
        _wait_behind(pending)
        member.claimed = pending.result()
        if member.claimed is None:
            member.claim_found = Outcome.SKIPPED
        elif not rows.same_first_steps(member.job, member.claimed):
            member.claim_found = _REFUTED
        else:
            rows.adopt(member.job, member.claimed)
    return member.claim_found


def _record_first_step_once_claimed(claim: Future[Job | None], job_id, at) -> None:
    """`services.record_first_step` once the claim of a step begun before it took the job (else nothing)."""
    if claim.result() is not None:
        services.record_first_step(job_id, at)


def _held_back_by_the_long_cap(task, job_id: str, from_step: int, worker: str, model: str = "") -> bool:
    """A long chunk met at the overload cap goes back to its queue (unclaimed, at its priority) and this
    worker stops reading long queues until the cap lets it (workers/long_cap.py)."""
    delivered_from = (task.request.delivery_info or {}).get("routing_key")  # the queue the message came from
    if delivered_from and class_of(delivered_from) != LONG:
        return False  # the common case: not a long chunk, no read at all
    if not selectors.long_cap_state().engaged:  # the common case: one Redis read, no database read
        return False
    found = selectors.queue_and_priority(job_id)
    if found is None or class_of(found[0]) != LONG or not selectors.must_leave_long(worker):
        return False
    queue, priority = found
    broker.send_chunk(job_id, from_step, queue, priority, model)
    long_cap.pause(task.app, task.request.hostname, _consumed_queues(queue))
    return True


def _denoise(members: list[_Member], worker: str, hop_from: float | None = None) -> str:
    """Run the jobs' chunks as one batch until each has left: finished its steps, yielded the card,
    stopped, or failed. Returns the outcome of the first (the job whose message this is). `hop_from`: when the
    first's first chunk was published, if it found this card idle (its first step then measures the HOP)."""
    lead = members[0].job
    by_id = {str(m.job.pk): m for m in members}
    task_started = time.monotonic()

    def should_stop(state: DenoiseState, step: int) -> str:
        member = by_id[job_id_of(state.request)]
        job_id = member.job.pk
        step += member.cursor.offset  # global over the segments
        if member.claim is None or step:  # a first step begun before its claim answered: the second waits for it
            stop = _confirmed(member)
            if stop:
                return stop
        stop = "" if member.flags_read_at_claim else _flagged(member)  # one Redis read fewer before the first step
        member.flags_read_at_claim = False
        if stop:
            return stop
        if step == 0:  # started_at, written beside the step (the boundary waits for it: nothing is recorded before)
            if member.claim is None:
                member.started = _after_the_boundary(services.record_first_step, job_id, timezone.now())
            else:
                member.started = _after_the_boundary(
                    _record_first_step_once_claimed, member.claim, job_id, timezone.now()
                )
            if hop_from is not None and member is members[0]:
                _after_the_boundary(services.learn_stage_seconds, lead.model, HOP, time.time() - hop_from)
        if time.monotonic() - member.last_beat > HEARTBEAT_EVERY_SECONDS:
            member.last_beat = time.monotonic()
            if not services.heartbeat(job_id, worker, steps_done=step):
                return Outcome.LEASE_LOST
        events.card_stepping()  # the step runs: background work may take the interpreter beside it
        return ""

    def keep_card(step: int) -> bool:
        """Run the next chunk here: nothing waits that this card would take first, time is left, and
        the worker is not stopping (a warm shutdown ends at this chunk; the next one is published)."""
        if step >= lead.total_steps or time.monotonic() - task_started > settings.CELERY_VISIBILITY_TIMEOUT / 2:
            return False
        if worker_state.should_stop is not None:  # SIGTERM/Ctrl-C: Celery's warm shutdown began
            return False
        if class_of(lead.queue) == LONG and selectors.must_leave_long(worker):
            return False  # the overload cap: this card yields its long job (and takes no more for now)
        global _handing_over
        queues = _consumed_queues(lead.queue)
        at_equal = yields_to_equal_priority(lead.duration_class)  # not to another started video: a swap costs
        _handing_over = broker.should_yield(
            queues, continuation_at(step), worker, settings.BOUNDARY_HOLD_SECONDS, at_equal=at_equal
        )
        return not _handing_over

    def continuation_at(step: int) -> int:
        """The priority the lead's next chunk would be published at from `step` (global over its segments)."""
        remaining = lead.estimated_seconds * (lead.total_steps - step) / lead.total_steps
        return priority_for(lead.duration_class, remaining, True, deployment.thresholds())

    last_cut_check = time.monotonic()

    def cut_short() -> bool:
        """Mid-chunk: end this chunk at the current step when a job published ahead of its user's turn (the
        lightest user's, services/fairness.py) has waited CUT_AFTER_SECONDS at a better priority than the
        lead's continuation and this card is the first to claim it. The chunk then ends as planned ones do:
        checkpoint, then the boundary's yield test hands the card over."""
        nonlocal last_cut_check
        if members[0].claim is not None:
            return False  # the lead's claim has not answered: its next step's check waits for it first
        now = time.monotonic()
        if now - last_cut_check < CUT_CHECK_SECONDS:
            return False
        last_cut_check = now
        continuation = continuation_at(members[0].cursor.offset + members[0].state.step)
        waited = CUT_AFTER_SECONDS * lead.clock_scale  # seconds of card time, on the deployment's clock
        return broker.claim_cut(_consumed_queues(lead.queue), continuation, worker, waited)

    def on_preview(state: DenoiseState, key: str, step: int) -> None:
        member = by_id[job_id_of(state.request)]
        if not _confirmed(member):  # a claim that did not take the job: its step is thrown away, with its preview
            services.record_preview(member.job.pk, worker, key, member.cursor.offset + step)

    family, store = family_of(lead, "denoise"), storage()
    try:
        encoded = _encode_new_prompts_together(members, store)
        fresh = hits = 0
        for m in members:
            encoder = card_encoder(m.job)
            m.state = _resume_state(m, family, store, encoder, worker)
            if encoder is not None and m.job.checkpoint_step == 0:  # its first chunk: the job's one lookup
                fresh += 1
                hits += not encoder.encoded and m.job.pk not in encoded
        if fresh:
            events.in_background(count_embedding_cache, hits, fresh - hits)  # off the way to the first step
        while running := [m for m in members if not m.outcome]:
            results = stages.run_merged_chunk(
                family,
                store,
                [m.state for m in running],
                until_step=min(lead.steps, running[0].state.step + lead.chunk_steps),
                preview_every=lead.preview_every,
                should_stop=should_stop,
                on_preview=on_preview,
                cut_short=cut_short,
                save=False,  # below, once the boundary knows whether the card keeps the jobs
            )
            boundary = time.perf_counter()
            results = [_claim_checked(m, ran) for m, ran in zip(running, results)]
            _first_steps_recorded(running)
            events.card_busy()  # until the next chunk's first step, or the task's end
            stages.embeddings_stored()  # encoded on this card: stored before anything is recorded that reads them
            going_on = [m.cursor.offset + ran.step for m, ran in zip(running, results) if not ran.stopped]
            stay = bool(going_on) and keep_card(max(going_on))
            for m, ran in zip(running, results):
                if ran.stopped == Outcome.STEPS_CHANGED:
                    m.outcome = _hand_back_for_new_total(m, worker, family, store)
                    continue
                if not ran.stopped and stay and not _checkpoint_due(m, ran):
                    m.outcome = _run_on_without_a_checkpoint(m, ran, worker)
                    continue
                saved = ran if ran.stopped else _save(m, family, store, ran, synced=not stay or _ends_a_stage(m, ran))
                m.outcome = _record_chunk(m, saved, worker, stay, store)
                if not m.outcome:
                    m.state = m.cursor.next_state(family, m.state)  # a segment's end: the next, from its seed
            took = time.perf_counter() - boundary  # the yield test, the checkpoints written, the rows recorded
            metrics.observe(metrics.CHUNK_BOUNDARY, lead.model, took)
            _after_the_boundary(services.learn_stage_seconds, lead.model, BOUNDARY, took)
    except Exception:  # noqa: BLE001 - recorded on each job, retried from its checkpoint
        error = traceback.format_exc()
        for m in members:
            with contextlib.suppress(Exception):  # a claim still on its way: whether the job is this task's
                _confirmed(m)
            if m.claim_found == Outcome.SKIPPED:
                m.outcome = m.claim_found  # never this task's: nothing to record
        with contextlib.suppress(Exception):  # its start before its failure, in its row and its events
            _first_steps_recorded(members)
        for m in members:
            if not m.outcome:  # still held here; the others were recorded and let go
                m.outcome = services.fail_attempt(m.job.pk, worker, error)
        with contextlib.suppress(Exception):  # a write still running: the retry encodes again if it failed
            stages.embeddings_stored()
    return members[0].outcome


def _claim_checked(member: _Member, ran: stages.ChunkResult) -> stages.ChunkResult:
    """A chunk that ran all its steps before the member's claim answered (a chunk of one step): the result stopped
    where the claim says the member stops."""
    found = "" if ran.stopped else _confirmed(member)
    return dataclasses.replace(ran, stopped=found) if found else ran


def _first_steps_recorded(members: list[_Member]) -> None:
    """The members' first-step writes are done: what the boundary records of a job follows its start."""
    for m in members:
        started, m.started = m.started, None
        _wait_behind(started)


def _encode_new_prompts_together(members: list[_Member], store) -> set:
    """A merged batch of a model that encodes on its card: the prompts of its new members that are not stored yet,
    in one text-encoder call (stages.encode batches them) before each member's load reads them. A job alone
    encodes its own prompt in its load (stages.load_state), without this lookup first. Returns the ids of the
    jobs whose prompts it encoded."""
    fresh = [m.job for m in members if m.job.checkpoint_step == 0]
    if len(fresh) < 2 or card_encoder(fresh[0]) is None:
        return set()
    results = stages.encode(family_of(fresh[0], "encode"), store, [request_of(job) for job in fresh])
    return {job.pk for job, result in zip(fresh, results) if not result.cache_hit}


def _ends_a_stage(member: _Member, result: stages.ChunkResult) -> bool:
    """Whether the chunk ended a segment (whose decode reads its checkpoint) or the job's steps."""
    job = member.job
    step = member.cursor.offset + result.step
    return step >= job.total_steps or (job.segment_count > 1 and step % job.steps == 0)


def _checkpoint_due(member: _Member, result: stages.ChunkResult) -> bool:
    """Whether a boundary where the card keeps the job writes its checkpoint: GENSERVER_CHECKPOINT_EVERY seconds
    of denoising (the job's clock) have run since the last one, or the chunk ended a stage (`_ends_a_stage`)."""
    if _ends_a_stage(member, result):
        return True
    every = float(settings.CHECKPOINT_EVERY_SECONDS) * member.job.clock_scale
    return member.unsaved_seconds + result.seconds >= every


def _save(member: _Member, family, store, result: stages.ChunkResult, synced: bool) -> stages.ChunkResult:
    """The chunk's checkpoint; `synced=False` (a boundary where the card keeps the job) leaves its fsync to the
    background thread (`_record_chunk`), once the previous one's is done: at most one checkpoint of the job is
    ever unsynced, so a power loss costs at most one chunk more than a crash."""
    if not synced:
        _wait_synced(member)
    return stages.save_chunk_end(family, store, member.state, result, synced=synced)


def _wait_synced(member: _Member) -> None:
    """Wait for the fsync of the member's last unsynced checkpoint; its error fails the attempt (the retry resumes
    from that checkpoint, still whole on this machine). The card lets background work run while it waits."""
    pending, member.unsynced = member.unsynced, None
    _wait_behind(pending)


def _sync_off_the_boundary(store, key: str, older: str) -> Future[None]:
    """`store.sync(key)` on the background thread, then the deletion of the checkpoint before it (`older`, if
    any): kept when the sync fails, as the one a power loss would leave. The future carries the sync's error."""
    synced: Future[None] = Future()

    def sync() -> None:
        try:
            store.sync(key)
        except StorageKeyMissing:
            pass  # gone already (the job ended and its files with it): nothing to make durable
        except BaseException as exc:
            synced.set_exception(exc)
            raise
        synced.set_result(None)
        if older:
            store.delete_prefix(older)

    _after_the_boundary(sync)
    return synced


def _resume_state(member: _Member, family, store, encoder, worker: str) -> DenoiseState:
    """The state to continue the job from: its recorded checkpoint, or, when that one cannot be read (written
    without its fsync before a power loss), the one before it in its segment (else the segment's start), which
    the job's row then records."""
    job = member.job
    try:
        return member.cursor.load_state(family, store, job.checkpoint_step, job.checkpoint_key, encoder)
    except stages.CheckpointUnreadable:
        start = member.cursor.segment_start(job.checkpoint_step)
        step, key = stages.previous_checkpoint(store, str(job.pk), job.checkpoint_step, start) or (start, "")
        if not services.resume_from_earlier_checkpoint(job.pk, worker, job.checkpoint_key, step, key):
            raise
        job.checkpoint_key, job.checkpoint_step, job.steps_done = key, step, step
        member.checkpoint_key = member.cursor.deletable(step, key)
        return member.cursor.load_state(family, store, step, key, encoder)


def _run_on_without_a_checkpoint(member: _Member, result: stages.ChunkResult, worker: str) -> str:
    """A kept boundary between checkpoints: no write, and of the row only the progress, the lease and the
    next chunk's start (one heartbeat); the chunk's seconds wait for the next recorded one, its step time is
    learned now. "" while the job stays, else how it left."""
    if not services.heartbeat(member.job.pk, worker, member.cursor.offset + result.step, chunk_starts=True):
        return Outcome.LEASE_LOST
    member.unsaved_seconds += result.seconds
    _after_the_boundary(services.learn_from_chunk, member.job, result.step_seconds, worker)
    return ""


def _record_chunk(member: _Member, result: stages.ChunkResult, worker: str, stay: bool, store) -> str:
    """Record one job's chunk (and those run on since its last checkpoint); "" while it stays in this task,
    else how it left."""
    job_id = member.job.pk
    if result.stopped:
        if result.stopped == Outcome.CANCELLED:
            services.finish_cancelled(job_id, worker, member.unsaved_seconds)
        return result.stopped
    step = member.cursor.offset + result.step  # global over a long video's segments
    chunk_seconds, member.unsaved_seconds = member.unsaved_seconds + result.seconds, 0.0
    if not services.finish_chunk(
        job_id,
        worker,
        step,
        result.checkpoint_key,
        result.step_seconds,
        keep_lease=stay,
        chunk_seconds=chunk_seconds,
        claimed=member.job,
        learn=False,
    ):
        return Outcome.SUPERSEDED
    _after_the_boundary(services.learn_from_chunk, member.job, result.step_seconds, worker)
    metrics.observe(metrics.CHECKPOINT_BYTES, member.job.model, result.checkpoint_bytes)
    older = member.checkpoint_key if member.checkpoint_key != result.checkpoint_key else ""
    if not result.checkpoint_synced:  # the older one stays until this one is on the disk
        member.unsynced = _sync_off_the_boundary(store, result.checkpoint_key, older)
    elif older:
        # The older checkpoint is no longer needed; an unlink right after an fsync can take
        # milliseconds, so it happens off the chunk boundary.
        _after_the_boundary(store.delete_prefix, older)
    member.checkpoint_key = member.cursor.deletable(step, result.checkpoint_key)  # a segment's end is kept
    return "" if stay else f"step {step}"


def _flagged(member: _Member) -> str:
    """ "cancelled", "steps-changed" (POST /steps/ set another total than the one this worker runs),
    or "". This runs before every step of every member, so the flags come from this process's subscription to
    their announcements (genserver/jobs/flags.py): a Redis read only when they may have changed."""
    values = flags.watch().current(member.job.pk)
    if values is None:
        return ""  # nothing announced for the job since its last read, which found neither flag
    cancelled, total = values
    if cancelled is not None:
        return Outcome.CANCELLED
    if total is not None and int(total) != member.job.steps:
        return Outcome.STEPS_CHANGED
    return ""


def _hand_back_for_new_total(member: _Member, worker: str, family, store) -> str:
    """Save the job's state at this step and give it back: the job service publishes its decode
    (stopped early) or the next chunk, which continues on a schedule for the new total."""
    state = member.state
    key = stages.save_checkpoint(family, store, state) if state.step > 0 else ""
    released = services.release_for_new_total(member.job.pk, worker, state.step, key)
    if released and key and member.checkpoint_key not in ("", key):
        _after_the_boundary(store.delete_prefix, member.checkpoint_key)
    return Outcome.STEPS_CHANGED
