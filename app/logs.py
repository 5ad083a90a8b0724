"""Logging: one JSON object per line, carrying the id of the request being served.

The request id lives in a context variable set by the request middleware, so any log call made while
serving a request (routes, handlers) carries it without passing it around. Work done on behalf of
several requests (the batcher) logs without one. Nothing here ever logs a request body, a header
value, or the API key: callers pass only what they mean to show. Every line is bounded whatever a
client sent (a 30 kB path, a field name in an exception's message): the message and each field are
clipped to MAX_FIELD_CHARS, a traceback to MAX_EXC_CHARS.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from typing import Any

request_id_var: ContextVar[str | None] = ContextVar("eg2_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
MAX_FIELD_CHARS = 1024
MAX_EXC_CHARS = 16384  # a traceback through torch runs to a few thousand characters


def clipped(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters]"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": clipped(record.getMessage()),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_") and key != "color_message":
                entry[key] = clipped(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exc"] = clipped(self.formatException(record.exc_info), MAX_EXC_CHARS)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = clipped(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return clipped(super().formatException(ei), MAX_EXC_CHARS)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        return f"{line} [request_id={request_id}]" if request_id else line


def setup_logging(level: str = "info", json_logs: bool = True) -> None:
    """Route every logger (ours and uvicorn's) through one stderr handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_logs else TextFormatter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in _UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True
