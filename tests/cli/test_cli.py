"""The `genserver` command-line client, run as a subprocess against the real ASGI server and workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import requests

from tests.support.live_server import ROOT
from tests.support.waits import finished, job_row, wait_for

pytestmark = pytest.mark.stack
PNG = b"\x89PNG\r\n\x1a\n"
# `python -m genserver_cli` with Ctrl-C as a terminal's foreground process gets it. A suite started in the
# background (`make test &`, a CI runner without job control) ignores SIGINT, its children inherit that, and Python
# then installs no KeyboardInterrupt handler: the CLI would never see the test's Ctrl-C.
CLI_WITH_CTRL_C = [
    sys.executable,
    "-c",
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('genserver_cli', run_name='__main__', alter_sys=True)",
]


def cli_env(server, token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GENSERVER_URL", "GENSERVER_TOKEN")}
    env["GENSERVER_URL"] = server.url
    if token is not None:
        env["GENSERVER_TOKEN"] = token
    return env


def genserver(server, token: str | None, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`genserver ARGS` (python -m genserver_cli, the console script's code) with GENSERVER_URL/TOKEN set."""
    return subprocess.run(
        [sys.executable, "-m", "genserver_cli", *args],
        cwd=ROOT,
        env=cli_env(server, token),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_the_console_script_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module, _, function = project["project"]["scripts"]["genserver"].partition(":")
    assert module == "genserver_cli.main" and function == "main"
    from genserver_cli import main

    assert callable(getattr(main, function))


def test_submit_wait_shows_progress_and_saves_the_image(stack, asgi_server, api_token, tmp_path):
    token = api_token("cli-user")
    done = genserver(
        asgi_server,
        token,
        "submit",
        "--model",
        "tiny-sd",
        "--prompt",
        "a red fox",
        "--size",
        "64x64",
        "--steps",
        "8",
        "--seed",
        "7",
        "--wait",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("job ")
    job_id = lines[0].split()[1]
    assert any(line.startswith("denoising [") or line.startswith("queued") for line in lines), lines
    assert any(line.startswith("decoding") for line in lines) or any("8/8 steps" in line for line in lines), lines
    saved = [Path(line.removeprefix("saved ")) for line in lines if line.startswith("saved ")]
    assert saved == [tmp_path / f"{job_id}-0.png"]
    assert saved[0].read_bytes().startswith(PNG)
    # The other commands on the same job.
    status = genserver(asgi_server, token, "status", job_id)
    assert status.returncode == 0 and job_id in status.stdout and "succeeded" in status.stdout
    listed = genserver(asgi_server, token, "list", "--status", "succeeded")
    assert listed.returncode == 0 and job_id in listed.stdout
    again = genserver(asgi_server, token, "download", job_id, "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again" / f"{job_id}-0.png").read_bytes() == saved[0].read_bytes()
    models = genserver(asgi_server, token, "models")
    assert models.returncode == 0 and "tiny-sd" in models.stdout
    assert genserver(asgi_server, token, "queues").returncode == 0


def test_submit_without_wait_prints_the_job_and_cancel_stops_it(stack, asgi_server, api_token):
    token = api_token("cli-canceller")
    submitted = genserver(
        asgi_server, token, "submit", "--model", "wan-sim", "--prompt", "waves", "--size", "832x480", "--frames", "81"
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    cancelled = genserver(asgi_server, token, "cancel", job_id)
    assert cancelled.returncode == 0 and job_id in cancelled.stdout
    assert finished(job_id, timeout=30).status == "cancelled"
    assert genserver(asgi_server, token, "status", job_id).returncode == 1  # cancelled


def test_a_failed_job_exits_1_with_its_error(stack, asgi_server, api_token, tmp_path):
    token = api_token("cli-failer")
    done = genserver(
        asgi_server, token, "submit", "--model", "faulty-sim", "--prompt", "x", "--wait", "--out", str(tmp_path)
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed" in done.stdout.splitlines()[-1]
    assert not list(tmp_path.iterdir())


def test_a_refused_submit_exits_2_and_says_when_to_retry(stack, asgi_server, api_token):
    token = api_token("cli-refused")
    long_video = {"model": "wan-sim", "prompt": "a long video", "width": 1280, "height": 720}
    first = requests.post(
        f"{asgi_server.url}/api/v1/jobs/", json=long_video, headers={"Authorization": f"Token {token}"}, timeout=30
    )
    assert first.status_code == 201, first.text
    try:
        refused = genserver(
            asgi_server, token, "submit", "--model", "wan-sim", "--prompt", "another", "--size", "1280x720"
        )
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "refused" in refused.stderr and "Retry in" in refused.stderr
    finally:
        requests.post(
            f"{asgi_server.url}/api/v1/jobs/{first.json()['id']}/cancel/",
            headers={"Authorization": f"Token {token}"},
            timeout=30,
        )


def test_usage_errors_exit_3(stack, asgi_server, api_token):
    token = api_token("cli-usage")
    assert genserver(asgi_server, token, "submit", "--model", "tiny-sd").returncode == 3  # no --prompt
    bad_size = genserver(asgi_server, token, "submit", "--model", "tiny-sd", "--prompt", "x", "--size", "big")
    assert bad_size.returncode == 3 and "WIDTHxHEIGHT" in bad_size.stderr
    unknown = genserver(asgi_server, token, "submit", "--model", "no-such-model", "--prompt", "x")
    assert unknown.returncode == 3 and "no-such-model" in unknown.stderr  # the server's 400, explained
    no_token = genserver(asgi_server, None, "models")
    assert no_token.returncode == 3 and "GENSERVER_TOKEN" in no_token.stderr
    assert genserver(asgi_server, "wrong", "models").returncode == 3  # 401


def test_ctrl_c_offers_to_cancel_the_job(stack, asgi_server, api_token, tmp_path):
    token = api_token("cli-interrupter")
    process = subprocess.Popen(
        [
            *CLI_WITH_CTRL_C,
            "submit",
            "--model",
            "wan-sim",
            "--prompt",
            "waves",
            "--size",
            "832x480",
            "--frames",
            "81",
            "--wait",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=cli_env(asgi_server, token),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = process.stdout.readline()
        assert first.startswith("job "), first + process.stderr.read()
        job_id = first.split()[1]
        wait_for(lambda: job_row(job_id).steps_done >= 1, 60, what="the video to start denoising")
        process.send_signal(signal.SIGINT)
        process.stdin.write("y\n")
        process.stdin.flush()
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, out + err
    assert "Cancel job" in out and "cancelled" in out.splitlines()[-1]
    assert finished(job_id, timeout=30).status == "cancelled"
