"""One structured log line per job transition, in JSON or text (GENSERVER_LOG_FORMAT)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from genserver.logs import JsonFormatter
from tests.support.api import submit

TRANSITIONS = logging.getLogger("genserver.transitions")


@pytest.fixture
def transition_lines() -> Iterator[io.StringIO]:
    """What the transitions logger writes, as JSON lines, at INFO whatever the test run's level."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    level = TRANSITIONS.level
    TRANSITIONS.addHandler(handler)
    TRANSITIONS.setLevel(logging.INFO)
    yield stream
    TRANSITIONS.removeHandler(handler)
    TRANSITIONS.setLevel(level)


@pytest.mark.django_db(transaction=True)
def test_submit_and_cancel_write_one_json_line_each(api, transition_lines):
    job = submit(api, model="tiny-sd", prompt="a quiet harbour", steps=4).json()
    assert api.post(f"/api/v1/jobs/{job['id']}/cancel/").status_code == 202
    lines = [json.loads(line) for line in transition_lines.getvalue().splitlines()]
    assert [(line["from"], line["to"]) for line in lines] == [(None, "queued"), ("queued", "cancelled")]
    for line in lines:
        assert line["event"] == "job.transition" and line["logger"] == "genserver.transitions"
        assert (line["job_id"], line["user"], line["model"], line["class"]) == (
            job["id"],
            "alice",
            "tiny-sd",
            job["duration_class"],
        )
        assert line["step"] == 0 and line["worker"] is None and line["node"] and line["seconds"] >= 0
    assert lines[1]["message"].startswith(f"job {job['id']} queued → cancelled (user alice, model tiny-sd")


@pytest.mark.django_db(transaction=True)
def test_a_worker_transition_names_the_worker_and_its_node(api, transition_lines):
    from genserver.jobs import services

    job_id = submit(api, model="tiny-sd", prompt="a quiet harbour", steps=4).json()["id"]
    assert services.start_encoding(job_id, "encode@gpu-node-7:4242") is not None
    line = json.loads(transition_lines.getvalue().splitlines()[-1])
    assert (line["from"], line["to"], line["worker"], line["node"]) == (
        "queued",
        "encoding",
        "encode@gpu-node-7:4242",
        "gpu-node-7",
    )


def configured_formatter(tmp_path, log_format: str) -> subprocess.CompletedProcess:
    """A fresh process that loads the real settings with GENSERVER_LOG_FORMAT, logs a Celery line and then
    one transition line."""
    code = (
        "import django, logging; django.setup(); "
        "logging.getLogger('celery.worker.consumer').info('Connected to redis'); "
        "logging.getLogger('genserver.transitions').info('job j queued → encoding', extra={'job_id': 'j'})"
    )
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="genserver.settings",
        GENSERVER_DATA_DIR=str(tmp_path),
        GENSERVER_LOG_FORMAT=log_format,
        GENSERVER_LOG_LEVEL="INFO",
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_log_format_json_text_or_refused(tmp_path):
    as_json = configured_formatter(tmp_path, "json")
    celery_line, transition_line = as_json.stderr.strip().splitlines()[-2:]
    assert json.loads(transition_line)["job_id"] == "j", as_json.stderr
    assert celery_line.startswith("[") and celery_line.endswith(": INFO/MainProcess] Connected to redis")  # Celery's
    as_text = configured_formatter(tmp_path, "text")
    assert as_text.stderr.strip().splitlines()[-1].endswith(" INFO genserver.transitions job j queued → encoding")
    refused = configured_formatter(tmp_path, "xml")
    assert refused.returncode != 0 and "GENSERVER_LOG_FORMAT" in refused.stderr
