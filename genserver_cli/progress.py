"""The live progress line: queue position and ETA while waiting, steps while denoising, then decoding.

On a terminal one line is redrawn in place; otherwise (a pipe, a log) each change is a new line.
"""

from __future__ import annotations

from typing import Any, TextIO

BAR = 30


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def describe(job: dict[str, Any]) -> str:
    """One line for the job's state."""
    status, progress = job.get("status", "?"), job.get("progress") or {}
    step, total = progress.get("step", 0), progress.get("total_steps") or 0
    eta = f" · ETA {fmt_seconds(job.get('eta_seconds'))}" if job.get("eta_seconds") is not None else ""
    if job.get("cancel_requested") and status not in ("cancelled", "succeeded", "failed", "expired"):
        return f"cancelling · step {step}/{total}"
    if status == "queued" or (
        status in ("denoising", "encoding") and job.get("stage") in ("queued", "waiting") and not step
    ):
        position = job.get("queue_position")
        return f"queued · position {position if position is not None else '?'}{eta}"
    if status in ("encoding", "denoising"):
        filled = int(BAR * step / total) if total else 0
        return f"{status} [{'#' * filled}{'-' * (BAR - filled)}] {step}/{total} steps{eta}"
    if status == "decoding":
        return f"decoding · {total}/{total} steps done"
    if status == "expired" and job.get("error"):
        return f"expired · {job['error']}"  # its start deadline passed before it started
    return status


class Progress:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.last = ""

    def show(self, job: dict[str, Any]) -> None:
        line = describe(job)
        if line == self.last:
            return
        if self.tty:
            self.out.write("\r\033[K" + line)
        else:
            self.out.write(line + "\n")
        self.out.flush()
        self.last = line

    def clear(self) -> None:
        if self.tty and self.last:
            self.out.write("\n")
            self.out.flush()
        self.last = ""

    def done(self) -> None:
        self.clear()
