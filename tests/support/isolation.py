"""No stack test inherits another's work: what a test leaves in flight is cancelled and waited out.

The workers outlive every test (one stack per session) and each transactional
test ends by emptying the tables. A job still in flight then (a test that
only needed its 201, or one that failed midway) would keep a card busy in
the next test, or be merged into its batch: tiny-wan merges same-shape jobs
(`max_merge`), and a merged row is within one level of 255 of a lone run,
not bit-equal. So after each stack test, before the tables are emptied,
every active job is cancelled and the workers are waited on until none
holds a job; before each, the same (cheap when nothing is left).
"""

from __future__ import annotations

from tests.support.waits import wait_for

SETTLE_SECONDS = 60.0  # a cancelled job stops within a step; a decoding one finishes its decode


def settle_stack(timeout: float = SETTLE_SECONDS) -> int:
    """Cancel every job still active and wait until none is; returns how many were cancelled."""
    from genserver.jobs import services
    from genserver.jobs.models import ACTIVE, Job

    leftovers = list(Job.objects.filter(status__in=ACTIVE))
    for job in leftovers:
        services.cancel_job(job)
    if leftovers:
        wait_for(
            lambda: not Job.objects.filter(status__in=ACTIVE).exists(),
            timeout,
            interval=0.1,
            what=f"the {len(leftovers)} jobs left in flight by a test to end",
        )
    return len(leftovers)


FLUSH_ATTEMPTS = 3


def flush_retrying_deadlocks(teardown):
    """Wrap TransactionTestCase._fixture_teardown: on PostgreSQL the tables' TRUNCATE takes exclusive locks
    while the session's workers (beat's reaper, a card's heartbeat) still read them, and the database may
    break that deadlock by aborting the flush. The flush is idempotent, so it is tried again; any other
    error, or a third deadlock, fails the test as before."""
    from django.core.management.base import CommandError

    def fixture_teardown(self) -> None:
        for attempt in range(1, FLUSH_ATTEMPTS + 1):
            try:
                return teardown(self)
            except CommandError as error:
                if attempt == FLUSH_ATTEMPTS or "deadlock detected" not in str(error.__cause__ or ""):
                    raise

    return fixture_teardown
