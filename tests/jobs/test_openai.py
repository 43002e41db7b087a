"""The OpenAI Images API shape: the official `openai` package as the client, against the running stack over HTTP."""

from __future__ import annotations

import base64
import io
import json
import urllib.request

import openai
import pytest
from PIL import Image

from genserver.jobs.models import Job
from tests.support.api import submit


@pytest.fixture
def token(transactional_db) -> str:  # transactional: the live server's thread reads the rows
    from django.contrib.auth import get_user_model

    from genserver.jobs.services import tokens

    user = get_user_model().objects.create_user(username="openai-user")
    return tokens.issue(user)[1]


def client_for(live_server, token: str) -> openai.OpenAI:
    # No retries: a retried generation would be a second job, and a 429 must surface at once.
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=token, max_retries=0, timeout=300)


def test_openai_client_generates_pngs_as_b64_json_and_as_urls(stack, live_server, token):
    client = client_for(live_server, token)
    assert "tiny-sd" in [m.id for m in client.models.list()]
    assert "tiny-wan" not in [m.id for m in client.models.list()], "video models are not OpenAI image models"

    result = client.images.generate(
        model="tiny-sd",
        prompt="a red fox in the snow",
        size="64x64",
        n=2,
        response_format="b64_json",
        extra_body={"num_inference_steps": 4, "seed": 7, "negative_prompt": "blurry"},
    )
    assert result.created > 0 and len(result.data) == 2
    for item in result.data:
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert image.format == "PNG" and image.size == (64, 64)
    job = Job.objects.get(pk=result.model_extra["job_id"])
    assert (job.status, job.steps, job.seed, job.num_outputs, job.negative_prompt) == ("succeeded", 4, 7, 2, "blurry")

    by_url = client.images.generate(
        model="tiny-sd",
        prompt="a red fox in the snow",
        size="64x64",
        response_format="url",
        extra_body={"num_inference_steps": 4, "seed": 7},
    )
    download = urllib.request.Request(by_url.data[0].url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(download, timeout=60) as answer:
        png = answer.read()
    assert Image.open(io.BytesIO(png)).size == (64, 64)


def test_a_user_at_the_in_flight_limit_gets_a_rate_limit_error(stack, live_server, token, settings):
    settings.MAX_JOBS_IN_FLIGHT = 1
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    native = APIClient()
    native.force_authenticate(get_user_model().objects.get(username="openai-user"))
    # A simulated 720p video: seconds of work, so it is still in flight when the image request comes.
    assert submit(native, model="wan-sim", width=1280, height=720, num_frames=81).status_code == 201

    with pytest.raises(openai.RateLimitError) as refused:
        client_for(live_server, token).images.generate(model="tiny-sd", prompt="a red fox", size="64x64")
    assert int(refused.value.response.headers["Retry-After"]) >= 1
    assert refused.value.body["code"] == "too_many_in_flight"
    assert Job.objects.count() == 1, "a refused request leaves no job row"


def test_wrong_token_is_an_authentication_error(live_server, token):
    with pytest.raises(openai.AuthenticationError) as refused:
        client_for(live_server, "not-a-token").images.generate(model="tiny-sd", prompt="a red fox")
    assert refused.value.body["code"] == "invalid_api_key"
    assert not Job.objects.exists()


def post(client, body, **headers):
    return client.post("/v1/images/generations", data=json.dumps(body), content_type="application/json", **headers)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a fox"}, "model"),
        ({"model": "dall-e-3", "prompt": "a fox"}, "model"),
        ({"model": "tiny-wan", "prompt": "a fox"}, "model"),
        ({"model": "tiny-sd"}, "prompt"),
        ({"model": "tiny-sd", "prompt": "   "}, "prompt"),
        ({"model": "tiny-sd", "prompt": "a fox", "size": "big"}, "size"),
        ({"model": "tiny-sd", "prompt": "a fox", "size": "4096x4096"}, "size"),
        ({"model": "tiny-sd", "prompt": "a fox", "size": "65x64"}, "size"),
        ({"model": "tiny-sd", "prompt": "a fox", "n": 5}, "n"),
        ({"model": "tiny-sd", "prompt": "a fox", "n": True}, "n"),
        ({"model": "tiny-sd", "prompt": "a fox", "response_format": "jpeg"}, "response_format"),
        ({"model": "tiny-sd", "prompt": "a fox", "num_inference_steps": 51}, "num_inference_steps"),
        ({"model": "tiny-sd", "prompt": "a fox", "guidance_scale": "NaN"}, "guidance_scale"),
        ({"model": "tiny-sd", "prompt": "a fox", "seed": -1}, "seed"),
        ({"model": "tiny-sd", "prompt": "a fox", "colour": "red"}, "colour"),
        ({"model": "tiny-sd", "prompt": 12345}, "prompt"),
        ({"model": "tiny-sd", "prompt": "a fox", "size": 512}, "size"),
        ({"model": "tiny-sd", "prompt": "a fox", "user": 42}, "user"),
        ({"model": "tiny-sd", "prompt": "a fox", "negative_prompt": ["x"]}, "negative_prompt"),
        ({"model": "tiny-sd", "prompt": "a fox", "response_format": 1}, "response_format"),
        ({"model": 3, "prompt": "a fox"}, "model"),
    ],
)
@pytest.mark.django_db
def test_bad_requests_get_openai_error_shape_and_leave_no_job(api, body, param):
    response = post(api, body)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert param in error["message"]
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_string_fields_say_they_must_be_strings(api):
    error = post(api, {"model": "tiny-sd", "prompt": 12345}).json()["error"]
    assert error["param"] == "prompt" and "must be a string" in error["message"].lower(), error
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_n_is_bounded_by_the_models_max_batch(api):
    error = post(api, {"model": "faulty-sim", "prompt": "a fox", "n": 2}).json()["error"]
    assert error["param"] == "n" and "At most 1 output for faulty-sim" in error["message"], error
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_not_json_missing_token_and_unknown_paths_answer_in_openai_shape(client):
    from django.contrib.auth import get_user_model

    from genserver.jobs.services import tokens

    assert client.post("/v1/images/generations", data="{}", content_type="application/json").status_code == 401
    missing = client.post("/v1/images/generations", data="{}", content_type="application/json").json()
    assert missing["error"]["code"] == "invalid_api_key"
    key = tokens.issue(get_user_model().objects.create_user(username="bob"))[1]
    auth = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    not_json = client.post("/v1/images/generations", data="prompt=a", content_type="text/plain", **auth)
    assert not_json.status_code == 415 and "error" in not_json.json()
    broken = client.post("/v1/images/generations", data="{", content_type="application/json", **auth)
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    unknown = client.get("/v1/images/variations", **auth)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert client.get("/v1/models", **auth).json()["object"] == "list"
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_job_that_outlasts_the_wait_is_named_so_the_client_can_poll_it(api, settings):
    settings.OPENAI_WAIT_SECONDS = 0  # no workers here: the job stays queued
    response = post(api, {"model": "tiny-sd", "prompt": "a fox", "size": "128x64"})
    assert response.status_code == 202, response.content
    body = response.json()
    job = Job.objects.get(pk=body["job_id"])
    assert (job.width, job.height, job.status) == (128, 64, "queued")
    assert body["data"] == [] and body["error"]["code"] == "job_pending"
    assert str(job.pk) in body["error"]["message"]
    assert response["Location"].endswith(f"/api/v1/jobs/{job.pk}/")
    assert api.get(response["Location"]).status_code == 200


@pytest.mark.django_db
def test_a_retry_with_the_same_idempotency_key_answers_the_first_job_and_says_so(api, settings):
    settings.OPENAI_WAIT_SECONDS = 0  # no workers here: the job stays queued
    body = {"model": "tiny-sd", "prompt": "a fox", "size": "64x64"}
    first = post(api, body, HTTP_IDEMPOTENCY_KEY="retry-1")
    again = post(api, body, HTTP_IDEMPOTENCY_KEY="retry-1")
    assert first.status_code == again.status_code == 202, again.content
    assert again.json()["job_id"] == first.json()["job_id"] and Job.objects.count() == 1
    assert "Idempotent-Replayed" not in first and again["Idempotent-Replayed"] == "true"


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)  # the workers read the job
@pytest.mark.parametrize(
    ("storage_backend", "delivery"), [("local", "presigned"), ("s3", "stream"), ("s3", "presigned")]
)
def test_a_url_answer_is_delivered_as_the_output_endpoint_delivers(storage_backend, delivery, stack, api, settings):
    """Presigned delivery on object storage: the store's short-lived URL, as GET .../outputs/0/ redirects to;
    otherwise (streamed delivery, or a local store, which has no URLs) that owner-checked endpoint's URL."""
    settings.OUTPUT_DELIVERY, settings.OUTPUT_URL_TTL_SECONDS = delivery, 120
    body = {"model": "tiny-sd", "prompt": "a fox", "size": "64x64", "num_inference_steps": 2, "response_format": "url"}
    response = post(api, body)
    assert response.status_code == 200, response.content
    url = response.json()["data"][0]["url"]
    job_id = response.json()["job_id"]
    if storage_backend == "s3" and delivery == "presigned":
        assert "X-Amz-Expires=120" in url and "/api/v1/" not in url
        with urllib.request.urlopen(url, timeout=30) as fetched:  # the client, straight from the store
            assert fetched.headers["Content-Type"] == "image/png"
            png = fetched.read()
    else:
        assert url == f"http://testserver/api/v1/jobs/{job_id}/outputs/0/"
        answer = api.get(url)
        assert answer.status_code == 200
        png = b"".join(answer.streaming_content)
    assert Image.open(io.BytesIO(png)).size == (64, 64)
