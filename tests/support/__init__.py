"""What many tests need, written once: condition waits, job helpers, the broker capture, runtime fakes.

    waits.py     wait_for, job_row, finished, settled (broker drained, workers idle): poll a condition,
                 never sleep a fixed time
    api.py       submit, download: the REST API as a client calls it
    broker.py    BROKER_MODULE, broker(), capture_sends(): what the job service publishes
    runtime.py   NoVAE: a VAE that fails the test when touched
    isolation.py settle_stack(): no stack test inherits another test's work

The stack itself (the launcher's workers and beat) boots from workers/local_workers.py,
shared with bench/.
"""
