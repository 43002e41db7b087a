"""The OpenAPI schema is one clients can be generated from: schemathesis, with all its checks, over every operation.

schemathesis reads /api/schema/ from the WSGI app and sends generated requests
(valid and invalid) to every operation, the OpenAI endpoints included; each
answer must be documented (status and body schema) and none may be a 5xx.
No workers run: a valid submit makes a queued job, and the waits (Prefer: wait,
the OpenAI endpoint) are set to 0 so they answer at once.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.config import SchemathesisConfig

from genserver.wsgi import application

EXAMPLES_PER_OPERATION = 10  # bounded: about 50 s of CPU for the whole schema (both modes, every operation)


@pytest.fixture
def token(db) -> str:
    from django.contrib.auth import get_user_model

    from genserver.jobs.models import ApiToken
    from genserver.jobs.services import tokens

    user = get_user_model().objects.create_user(username="schemathesis")
    # Never expiring: a token made with it may then ask for any lifetime the schema allows. Moved far from the
    # ids DELETE /api/v1/tokens/{id}/ is generated with, so the run does not revoke its own token midway.
    token, key = tokens.issue(user, never_expires=True)
    ApiToken.objects.filter(pk=token.pk).update(id=2**40)
    return key


# A schema-valid request can still break a limit of the model it names (the registry's sizes, steps,
# prompt length, preview_every ≤ steps): JSON Schema cannot say "width ≤ the chosen model's max_width".
# On the submit operations, a 400 for such a request is correct, not a rejected valid request.
_REGISTRY_REFINED = r"^/(api/v1/jobs/|api/v1/jobs/\{job_id\}/steps/|v1/images/generations)$"
# An invalid request may also be too large to read (413: the body limit, GENSERVER_MAX_BODY_BYTES, comes
# before any parsing); schemathesis' default list of rejections lacks it.
_REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]
_CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {"negative_data_rejection": {"expected-statuses": _REJECTIONS}},
        "operations": [
            {
                "include-path-regex": _REGISTRY_REFINED,
                "checks": {
                    "positive_data_acceptance": {"expected-statuses": ["2xx", "400", "401", "404", "409", "429"]}
                },
            }
        ],
    }
)


def run_schemathesis(token: str, examples: int = EXAMPLES_PER_OPERATION) -> list[str]:
    """Every operation, valid and invalid generated requests, all checks; the failures as text (empty: none)."""
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_wsgi("/api/schema/", application, config=_CONFIG)
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate],
            )
            def exercise(case) -> None:
                case.call_and_validate(headers={"Authorization": f"Token {token}"})

            try:
                exercise()
            except Unsatisfiable:
                pass  # no parameter or body to make invalid: the operation has no negative case
            except (Exception, BaseExceptionGroup) as failure:  # noqa: BLE001 - collected: one run reports every operation's failures
                failures.append(f"{operation.label} ({mode.value}): {failure}")
    return failures


@pytest.fixture
def wsgi_in_test_transaction(db, settings):
    """The WSGI app in this process answers inside the test's transaction, without waiting on jobs."""
    settings.OPENAI_WAIT_SECONDS = 0
    settings.PREFER_WAIT_MAX_SECONDS = 0
    # As Django's test client does: a request's end must not close the test's connection.
    signals.request_finished.disconnect(close_old_connections)
    signals.request_started.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


def test_every_operation_answers_what_the_schema_documents(wsgi_in_test_transaction, token):
    failures = run_schemathesis(token)
    assert not failures, "\n\n".join(failures)


@pytest.mark.django_db
def test_schema_lists_registry_models_and_array_answers(api):
    """The points a generated client depends on: the model enum, the list endpoints' arrays, one error shape."""
    from genserver import deployment

    doc = api.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    components = doc["components"]["schemas"]
    assert sorted(components["JobCreateModelEnum"]["enum"]) == sorted(deployment.registry().names())
    image_names = [n for n in deployment.registry().names() if deployment.registry().get(n).kind == "image"]
    openai_enum = next(v for k, v in components.items() if k.startswith("ImageGenerationRequestModel"))
    assert sorted(openai_enum["enum"]) == sorted(image_names)
    for path in ("/api/v1/models/", "/api/v1/queues/"):
        assert doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["type"] == "array"
        assert isinstance(api.get(path).json(), list)
    submit = doc["paths"]["/api/v1/jobs/"]["post"]["responses"]
    for code in ("400", "401", "413", "415", "422", "429", "503"):
        assert submit[code]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert "/v1/images/generations" in doc["paths"] and "/v1/models" in doc["paths"]
    # the event stream, an async view outside DRF, is documented too (and so exercised by the run above)
    stream = doc["paths"]["/api/v1/jobs/{job_id}/events/"]["get"]
    assert "text/event-stream" in stream["responses"]["200"]["content"]
    error = {"$ref": "#/components/schemas/Error"}
    for code in ("401", "404"):
        assert stream["responses"][code]["content"]["application/json"]["schema"] == error
    assert stream["security"] == doc["paths"]["/api/v1/jobs/{job_id}/"]["get"]["security"]
