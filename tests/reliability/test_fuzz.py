"""5. Bad input: the API fuzzed from its own OpenAPI schema, and hostile requests refused up front.

Schemathesis generates valid and invalid requests (bodies, path and query
parameters) for every operation of /api/schema/ and sends them through the
whole Django stack (WSGI, middleware, token authentication). Every response
must be below 500; every refusal a 4xx with a readable body; and a request
that was not accepted (anything but 201) must leave no Job row.

    make test                                        # 30 examples per operation and mode
    GENSERVER_FUZZ_EXAMPLES=400 GENSERVER_FUZZ_REPORT=fuzz.json \\
        .venv/bin/python -m pytest tests/reliability/test_fuzz.py -k schema -p no:cacheprovider
                                                     # several thousand requests; totals in fuzz.json

Limits (rate, jobs in flight) are lifted during the fuzz so that validation,
not the limiter, answers; they have their own tests (test_tenancy.py).
"""

from __future__ import annotations

import json
from collections import Counter

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from genserver.config import env_int, env_str
from genserver.jobs.models import Job

pytestmark = pytest.mark.django_db

EXAMPLES = env_int("GENSERVER_FUZZ_EXAMPLES", 30, minimum=1)
REPORT = env_str("GENSERVER_FUZZ_REPORT", "")  # a JSON file for the totals; "" writes none
TALLY: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def fuzz_totals():
    yield
    if not TALLY:
        return
    summary = {
        "requests": TALLY["requests"],
        "jobs_created": TALLY["created"],
        "replayed": TALLY["replayed"],
        "by_status": {k[7:]: v for k, v in sorted(TALLY.items()) if k.startswith("status ")},
        "server_errors": sum(v for k, v in TALLY.items() if k.startswith("status 5")),
        "rows_from_refused_requests": TALLY["rows_from_refused"],
    }
    print(f"\nfuzz totals: {json.dumps(summary)}")
    if REPORT:
        with open(REPORT, "w") as fh:
            json.dump(summary, fh, indent=2)


@pytest.fixture
def wsgi_request_cycle(settings):
    """Limits lifted; and the request cycle of a real server, minus closing stale connections around
    each request (that would close the test's transaction under it; Django's test client does the same)."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    settings.SUBMIT_RATE_LIMIT = 0
    settings.MAX_JOBS_IN_FLIGHT = 0
    # No worker runs here: a synchronous wait (OpenAI's endpoint, Prefer: wait) ends at once, with no live
    # worker to run its job (selectors.wait_for_terminal).
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def token(django_user_model):
    from genserver.jobs.services import tokens

    user = django_user_model.objects.create_user(username="fuzzer")
    return tokens.issue(user)[1]


def _load_schema():
    """The schema as served, called in-process over WSGI (schemathesis' lazy fixture loader does not
    run on pytest 9, so it is loaded at collection; that needs no database)."""
    from django.core.wsgi import get_wsgi_application

    loaded = schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application())
    loaded.config.generation.update(max_examples=EXAMPLES)
    return loaded


schema = _load_schema()


def header(response, name: str) -> str:
    """A response header, "" when absent: from Django's test client (case-insensitive, a string) or from
    schemathesis' call (names lower-cased, each value a list; a plain `.get("Content-Type")` finds nothing)."""
    for key, value in response.headers.items():
        if key.lower() == name.lower():
            return value[0] if isinstance(value, list) else value
    return ""


def readable(response) -> str:
    """The refusal's message: JSON with a detail or field errors, or a non-empty text page."""
    body = response.content if hasattr(response, "content") else response.text.encode()
    kind = header(response, "Content-Type")
    if "json" in kind:
        data = json.loads(body)
        assert isinstance(data, (dict, list)) and data, body[:300]
        return json.dumps(data)[:300]
    text = body.decode("utf-8")
    assert text.strip(), "an empty error body"
    return text[:300]


@schema.parametrize()
@hypothesis.settings(deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
def test_schema_fuzz_never_500_and_refusals_leave_no_row(case, token, wsgi_request_cycle):
    from genserver import deployment

    meta = getattr(case, "meta", None)
    positive = meta is not None and not meta.generation.mode.is_negative
    if positive and case.method == "POST" and isinstance(case.body, dict) and "model" in case.body:
        # The schema types `model` as a string; name a real one so generated jobs also get accepted.
        names = deployment.registry().names()
        case.body["model"] = names[TALLY["requests"] % len(names)]
    before_ids = set(Job.objects.values_list("pk", flat=True))
    before = len(before_ids)
    response = case.call(headers={"Authorization": f"Token {token}"})
    TALLY["requests"] += 1
    TALLY[f"status {response.status_code}"] += 1
    case.validate_response(response, checks=[not_a_server_error])
    assert response.status_code < 500
    after_ids = set(Job.objects.values_list("pk", flat=True))
    after = len(after_ids)
    # What the request did to the table, named when an assertion below fails: the rows it made and took
    # away, and the job its answer names.
    changed = f"made {sorted(map(str, after_ids - before_ids))}, gone {sorted(map(str, before_ids - after_ids))}, " + (
        f"answer {response.text[:300]!r}, headers {dict(response.headers)}"
    )
    # Accepted work: a native submit's 201, or the OpenAI endpoint's 202 (the job runs on; the answer names it).
    # (POST /api/v1/tokens/'s 201 makes a token, not a job.)
    accepted = (response.status_code == 201 and case.path == "/api/v1/jobs/") or (
        case.path == "/v1/images/generations" and response.status_code == 202
    )
    if accepted and header(response, "Idempotent-Replayed") == "true":
        # A generated Idempotency-Key used twice with the same request: the first request's job, and no new row.
        TALLY["replayed"] += 1
        assert after == before, changed
        assert str(response.json().get("id") or response.json().get("job_id")) in map(str, before_ids), changed
    elif accepted:
        TALLY["created"] += 1
        assert after == before + 1, changed
    else:
        TALLY["rows_from_refused"] += after - before
        assert after == before, f"{case.method} {case.path} → {response.status_code} left a row: {changed}"
    if response.status_code >= 400:
        assert response.status_code < 500
        readable(response)


# --- hostile requests, each refused before anything is written ------------------------------


def post(client, body, content_type="application/json"):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post("/api/v1/jobs/", data=data, content_type=content_type)


@pytest.mark.parametrize(
    "body, status, field",
    [
        ({"model": "sdxl-sim", "prompt": "x" * 70_000}, 413, None),  # over the 64 KiB body limit
        ({"model": "sdxl-sim", "prompt": "x" * 19_000}, 400, "prompt"),  # under it, over the model's limit
        ({"model": "sdxl-sim", "prompt": "p", "negative_prompt": "n" * 19_000}, 400, "negative_prompt"),
        ({"model": "sdxl-sim", "prompt": "p", "width": 100_000, "height": 100_000}, 400, "width"),
        ({"model": "sdxl-sim", "prompt": "p", "width": 2**70}, 400, "width"),
        ({"model": "wan-sim", "prompt": "p", "num_frames": 10_001}, 400, "num_frames"),
        ({"model": "wan-sim", "prompt": "p", "num_frames": 1_000_001}, 400, "num_frames"),
        ({"model": "sdxl-sim", "prompt": "p", "steps": 10**9}, 400, "steps"),
        ({"model": "sdxl-sim", "prompt": "p", "steps": -1}, 400, "steps"),
        ({"model": "sdxl-sim", "prompt": "p", "steps": 0}, 400, "steps"),
        ({"model": "sdxl-sim", "prompt": "p", "steps": 2.5}, 400, "steps"),
        ({"model": "sdxl-sim", "prompt": "p", "width": -512}, 400, "width"),
        ({"model": "sdxl-sim", "prompt": "p", "seed": -5}, 400, "seed"),
        ({"model": "sdxl-sim", "prompt": "p", "guidance_scale": "NaN"}, 400, "guidance_scale"),
        ({"model": "sdxl-sim", "prompt": "p", "guidance_scale": "inf"}, 400, "guidance_scale"),
        ({"model": "sdxl-sim", "prompt": "p", "guidance_scale": -0.5}, 400, "guidance_scale"),
        ({"model": "sdxl-sim", "prompt": "p", "num_outputs": 1000}, 400, "num_outputs"),
        ({"model": "sdxl-sim", "prompt": "p", "preview_every": -1}, 400, "preview_every"),
        ({"model": "sdxl-sim", "prompt": "p\u0000"}, 400, "prompt"),
        ({"model": "sdxl-sim", "prompt": ["a", "list"]}, 400, "prompt"),
        ({"model": {"$gt": ""}, "prompt": "p"}, 400, "model"),
        ({"model": "../../etc/passwd", "prompt": "p"}, 400, "model"),
    ],
)
def test_absurd_values_are_refused_with_a_reason_and_no_row(api, body, status, field):
    response = post(api, body)
    assert response.status_code == status, response.content[:300]
    message = response.json()
    assert (field in message) if field else message["reason"] == "too_large"
    assert Job.objects.count() == 0


@pytest.mark.parametrize(
    "raw",
    [
        '{"model": "sdxl-sim", "prompt": "p", "guidance_scale": NaN}',
        '{"model": "sdxl-sim", "prompt": "p", "guidance_scale": Infinity}',
        '{"model": "sdxl-sim", "prompt": "p", "guidance_scale": 1e999}',
        '{"model": "sdxl-sim", "prompt": "p", "seed": ' + "9" * 5000 + "}",
        "[" * 30_000 + "]" * 30_000,  # nested deeper than the decoder's recursion limit (was a 500)
        '{"model": "sdxl-sim", "prompt": "p",',
        "",
        "null",
        '"a string"',
        b"\xff\xfe\x00{}",
        '{"model": "sdxl-sim", "prompt": "\\ud800"}',
    ],
)
def test_malformed_json_is_a_400_with_a_reason(api, raw):
    response = post(api, raw)
    assert response.status_code == 400, response.content[:300]
    assert readable(response)
    assert Job.objects.count() == 0


@pytest.mark.parametrize(
    "content_type, data",
    [
        ("text/plain", '{"model": "sdxl-sim", "prompt": "p"}'),
        ("application/x-www-form-urlencoded", "model=sdxl-sim&prompt=p"),
        (
            "multipart/form-data; boundary=X",
            '--X\r\nContent-Disposition: form-data; name="model"\r\n\r\nsdxl-sim\r\n--X--',
        ),
        ("application/xml", "<job><model>sdxl-sim</model></job>"),
        ("", '{"model": "sdxl-sim", "prompt": "p"}'),
    ],
)
def test_other_content_types_are_415(api, content_type, data):
    response = api.generic("POST", "/api/v1/jobs/", data, content_type=content_type)
    assert response.status_code == 415, response.content[:300]
    assert "media type" in response.json()["detail"]
    assert Job.objects.count() == 0


def test_a_lying_content_length_cannot_smuggle_a_big_body(api):
    response = api.generic(
        "POST",
        "/api/v1/jobs/",
        json.dumps({"model": "sdxl-sim", "prompt": "p"}),
        content_type="application/json",
        CONTENT_LENGTH="999999999",
    )
    assert response.status_code == 413 and response.json()["reason"] == "too_large"
    assert Job.objects.count() == 0
