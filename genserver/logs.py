"""Log formatting: one JSON object per line (GENSERVER_LOG_FORMAT=json) for log collectors, or plain text."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

# What every LogRecord carries; anything else on a record came from `extra=` and is a field of its line.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """`{"ts": ..., "level": ..., "logger": ..., "message": ..., **extra}` on one line.

    The fields a caller passed with `extra=` (a job transition's job id, user,
    model, ...) are top-level keys, so a log collector can filter on them
    without parsing the message.
    """

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({k: v for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)
