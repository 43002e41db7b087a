"""`genserver`: submit and watch jobs from a terminal (GENSERVER_URL, GENSERVER_TOKEN).

    genserver submit --model tiny-sd --prompt "a red fox" --wait --out ./out
    genserver status JOB | list [--status S] | cancel JOB | download JOB [--out DIR] | models | queues

Exit codes: 0 succeeded (or done), 1 failed or cancelled (or an API error), 2 refused (429: the
server is overloaded or you submit too fast; when to retry is printed), 3 usage error (bad arguments,
a field the server refused, no token), 130 interrupted and left running.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from genserver_cli.api import TERMINAL, Api, ApiError
from genserver_cli.progress import Progress, fmt_seconds

OK, FAILED, REFUSED, USAGE, INTERRUPTED = 0, 1, 2, 3, 130
EXTENSIONS = {"image/png": ".png", "video/mp4": ".mp4", "image/jpeg": ".jpg", "image/webp": ".webp"}


class UsageError(Exception):
    """Bad arguments or environment: exit 3 with the message."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors exit 3, not 2 (2 means refused)
        self.print_usage(sys.stderr)
        print(f"genserver: error: {message}", file=sys.stderr)
        sys.exit(USAGE)


def size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT, e.g. 1024x1024")
    return int(width), int(height)


def build_parser() -> Parser:
    parser = Parser(prog="genserver", description="The genserver API from a terminal (GENSERVER_URL, GENSERVER_TOKEN).")
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead of a summary")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    submit = commands.add_parser("submit", help="submit a job (with --wait: follow it and save its outputs)")
    submit.add_argument("--model", required=True)
    submit.add_argument("--prompt", required=True)
    submit.add_argument("--negative-prompt")
    submit.add_argument("--size", type=size, help="WIDTHxHEIGHT, e.g. 1024x1024")
    submit.add_argument("--frames", type=int, help="video frames")
    submit.add_argument("--steps", type=int)
    submit.add_argument("--seed", type=int)
    submit.add_argument("--outputs", type=int, help="how many images (1-4)")
    submit.add_argument("--preview-every", type=int)
    submit.add_argument("--wait", action="store_true", help="show progress until it ends, then save the outputs")
    submit.add_argument("--out", default=".", help="folder for the outputs (with --wait; default: here)")
    for name, text in (("status", "a job's state"), ("cancel", "cancel a job"), ("download", "save a job's outputs")):
        command = commands.add_parser(name, help=text)
        command.add_argument("job")
        if name == "download":
            command.add_argument("--out", default=".")
    listing = commands.add_parser("list", help="your jobs, newest first")
    listing.add_argument("--status")
    listing.add_argument("--limit", type=int, default=20)
    commands.add_parser("models", help="the models you can use")
    commands.add_parser("queues", help="per class: depth, backlog, workers, whether it accepts work")
    return parser


def api_from_env() -> Api:
    url, token = os.environ.get("GENSERVER_URL", "http://127.0.0.1:8000"), os.environ.get("GENSERVER_TOKEN", "")
    if not token:
        raise UsageError("set GENSERVER_TOKEN (`python manage.py issue_token USER` prints one; `make up` shows it)")
    return Api(url, token)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        api = api_from_env()
        return COMMANDS[args.command](api, args)
    except UsageError as error:
        print(f"genserver: {error}", file=sys.stderr)
        return USAGE
    except ApiError as error:
        return report_api_error(error)


def report_api_error(error: ApiError) -> int:
    if error.status == 429:
        when = error.retry_after or (error.body.get("retry_after") if isinstance(error.body, dict) else None)
        print(
            f"genserver: refused: {error}. Retry in {when} s." if when else f"genserver: refused: {error}",
            file=sys.stderr,
        )
        return REFUSED
    print(f"genserver: {error}", file=sys.stderr)
    return USAGE if error.status in (400, 401, 403, 404, 413, 415, 422) else FAILED


# --- commands ----------------------------------------------------------------------------


def cmd_submit(api: Api, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"model": args.model, "prompt": args.prompt}
    if args.size:
        body["width"], body["height"] = args.size
    for option, name in (
        ("frames", "num_frames"),
        ("steps", "steps"),
        ("seed", "seed"),
        ("outputs", "num_outputs"),
        ("negative_prompt", "negative_prompt"),
        ("preview_every", "preview_every"),
    ):
        if getattr(args, option) is not None:
            body[name] = getattr(args, option)
    job = api.call("POST", "/api/v1/jobs/", body)
    if not args.wait:
        print(
            json.dumps(job, indent=2)
            if args.json
            else f"{job['id']}  {job['status']}  "
            f"(ETA {fmt_seconds(job.get('eta_seconds'))}; follow it: genserver status {job['id']})"
        )
        return OK
    print(f"job {job['id']} ({job['model']}, {job['duration_class']})", flush=True)
    return follow(api, job, Path(args.out), args.json)


def follow(api: Api, job: dict[str, Any], out: Path, as_json: bool) -> int:
    """Progress from the event stream until the job ends; Ctrl-C offers to cancel it."""
    progress = Progress(sys.stdout)
    try:
        progress.show(job)
        for update in api.events(job["id"]):
            job = update
            progress.show(job)
    except KeyboardInterrupt:
        progress.clear()
        if not ask(f"Cancel job {job['id']}? [y/N] "):
            print(f"job {job['id']} continues; `genserver status {job['id']}` shows it", flush=True)
            return INTERRUPTED
        job = api.call("POST", f"/api/v1/jobs/{job['id']}/cancel/")
        print(f"cancelling job {job['id']}", flush=True)
        for update in api.events(job["id"]):
            job = update
            progress.show(job)
    progress.done()
    return finish(api, job, out, as_json)


def ask(question: str) -> bool:
    try:
        print(question, end="", flush=True)
        return sys.stdin.readline().strip().lower() in ("y", "yes")
    except KeyboardInterrupt:  # a second Ctrl-C: leave it running
        return False


def finish(api: Api, job: dict[str, Any], out: Path, as_json: bool) -> int:
    if job["status"] != "succeeded":
        error = (job.get("error") or "").strip().splitlines()
        print(f"job {job['id']} {job['status']}" + (f": {error[-1][:300]}" if error else ""), flush=True)
        return FAILED
    paths = save_outputs(api, job, out)
    if as_json:
        print(json.dumps(job | {"saved": [str(p) for p in paths]}, indent=2))
    else:
        for path in paths:
            print(f"saved {path}")
    return OK


def save_outputs(api: Api, job: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, output in enumerate(job.get("outputs") or []):
        target = out / f"{job['id']}-{index}{EXTENSIONS.get(output['content_type'], '.bin')}"
        api.download(output["url"], target)
        paths.append(target)
    return paths


def cmd_status(api: Api, args: argparse.Namespace) -> int:
    job = api.call("GET", f"/api/v1/jobs/{args.job}/")
    print(json.dumps(job, indent=2) if args.json else summary(job))
    return FAILED if job["status"] in ("failed", "cancelled", "expired") else OK


def cmd_cancel(api: Api, args: argparse.Namespace) -> int:
    job = api.call("POST", f"/api/v1/jobs/{args.job}/cancel/")
    print(json.dumps(job, indent=2) if args.json else summary(job))
    return OK


def cmd_download(api: Api, args: argparse.Namespace) -> int:
    job = api.call("GET", f"/api/v1/jobs/{args.job}/")
    if job["status"] != "succeeded":
        print(f"job {job['id']} is {job['status']}: nothing to download", file=sys.stderr)
        return FAILED if job["status"] in TERMINAL else USAGE
    for path in save_outputs(api, job, Path(args.out)):
        print(f"saved {path}")
    return OK


def cmd_list(api: Api, args: argparse.Namespace) -> int:
    query = f"?limit={args.limit}" + (f"&status={args.status}" if args.status else "")
    page = api.call("GET", f"/api/v1/jobs/{query}")
    jobs = page["results"] if isinstance(page, dict) else page
    print(json.dumps(jobs, indent=2) if args.json else "\n".join(summary(j) for j in jobs) or "no jobs")
    return OK


def cmd_models(api: Api, args: argparse.Namespace) -> int:
    body = api.call("GET", "/api/v1/models/")
    models = body.get("models", body.get("results", body)) if isinstance(body, dict) else body
    if args.json:
        print(json.dumps(models, indent=2))
    else:
        for model in models:
            print(
                f"{model.get('name', '?'):24} {model.get('kind', ''):6} {model.get('family', ''):10} "
                f"{model.get('description', '')}"
            )
    return OK


def cmd_queues(api: Api, args: argparse.Namespace) -> int:
    body = api.call("GET", "/api/v1/queues/")
    queues = body.get("queues", body.get("results", body)) if isinstance(body, dict) else body
    if args.json or not isinstance(queues, list):
        print(json.dumps(queues, indent=2))
    else:
        for queue in queues:
            print("  ".join(f"{key}={value}" for key, value in queue.items() if not isinstance(value, dict | list)))
    return OK


def summary(job: dict[str, Any]) -> str:
    progress = job.get("progress") or {}
    line = (
        f"{job['id']}  {job['status']:9} {job.get('model', '')}  step {progress.get('step', 0)}/"
        f"{progress.get('total_steps', '?')}"
    )
    if job.get("queue_position"):
        line += f"  position {job['queue_position']}"
    if job.get("eta_seconds") is not None and job["status"] not in TERMINAL:
        line += f"  ETA {fmt_seconds(job['eta_seconds'])}"
    if job.get("error"):
        line += f"  error: {job['error'].strip().splitlines()[-1][:200]}"
    return line


COMMANDS = {
    "submit": cmd_submit,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "download": cmd_download,
    "list": cmd_list,
    "models": cmd_models,
    "queues": cmd_queues,
}


if __name__ == "__main__":
    sys.exit(main())
