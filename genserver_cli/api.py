"""The genserver HTTP API as the CLI calls it: JSON requests, file downloads, and a job's event stream.

Standard library only (urllib), so the client installs anywhere without the service's dependencies.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin

USER_AGENT = "genserver-cli/1"
TERMINAL = ("succeeded", "failed", "cancelled", "expired")


@dataclass
class ApiError(Exception):
    """The API answered an error status (or could not be reached: status 0)."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.status == 0:
            return str(self.body)
        if isinstance(self.body, dict):
            detail = self.body.get("detail")
            if detail:
                return f"{self.status}: {detail}"
            return f"{self.status}: " + "; ".join(
                f"{k}: {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in self.body.items()
            )
        return f"{self.status}: {self.body}"

    @property
    def retry_after(self) -> str | None:
        return self.headers.get("retry-after")


class Api:
    """One API base URL and token (GENSERVER_URL, GENSERVER_TOKEN)."""

    def __init__(self, base_url: str, token: str, timeout: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/") + "/"
        self.token = token
        self.timeout = timeout

    def url(self, path: str) -> str:
        return urljoin(self.base_url, path.lstrip("/")) if not path.startswith("http") else path

    def _request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> urllib.request.Request:
        data = json.dumps(body).encode() if body is not None else None
        all_headers = {
            "Authorization": f"Token {self.token}",
            "User-Agent": USER_AGENT,
            "Accept": "application/json",
            **(headers or {}),
        }
        if data is not None:
            all_headers["Content-Type"] = "application/json"
        return urllib.request.Request(self.url(path), data=data, method=method, headers=all_headers)

    def _open(self, request: urllib.request.Request, timeout: float | None = None):
        try:
            return urllib.request.urlopen(request, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                body: Any = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")[:500]
            raise ApiError(error.code, body, {k.lower(): v for k, v in error.headers.items()}) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ApiError(0, f"cannot reach {request.full_url}: {reason} (is GENSERVER_URL right?)") from None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        with self._open(self._request(method, path, body)) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def download(self, url: str, target) -> None:
        with self._open(self._request("GET", url, headers={"Accept": "*/*"})) as response, open(target, "wb") as out:
            while chunk := response.read(1 << 16):
                out.write(chunk)

    def events(self, job_id: str, reconnects: int = 20) -> Iterator[dict[str, Any]]:
        """The job's representation at each event, until it ends; a dropped connection resumes (Last-Event-ID)."""
        last_id, failures = "", 0
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
            if last_id:
                headers["Last-Event-ID"] = last_id
            request = self._request("GET", f"/api/v1/jobs/{job_id}/events/", headers=headers)
            try:
                with self._open(request, timeout=max(self.timeout, 90.0)) as response:
                    if response.status == 204:
                        return  # the server says we have the end
                    for event_id, job in _parse(response):
                        last_id, failures = event_id or last_id, 0
                        yield job
                        if job.get("status") in TERMINAL:
                            return
            except ApiError as error:
                if error.status != 0:
                    raise
                failures += 1
            except (TimeoutError, OSError, ValueError):
                failures += 1
            if failures > reconnects:
                raise ApiError(0, f"the event stream of job {job_id} kept dropping; try `genserver status {job_id}`")
            time.sleep(min(5.0, 0.5 * 2**failures))


def _parse(response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(id, job) for each `data:` event of a text/event-stream body; comments (keep-alives) are skipped."""
    event_id, data = "", []
    for raw in response:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield event_id, json.loads("\n".join(data))
            data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            event_id = value
        elif name == "data":
            data.append(value)
