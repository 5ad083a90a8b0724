"""Errors: every failure a client can see, mapped to one HTTP status and OpenAI error body in ONE table.

Body: `{"error": {"message", "type", "param", "code"}}`, the shape the OpenAI SDKs parse. `type` and
`code` both carry the documented name of the row (`invalid_request_error`, `model_not_found`, ...).
Messages come from exceptions raised on purpose (runtime `EG2Error`s and the app errors below), which
are written to be safe to show. Anything else is a bug: the client gets a generic 500 naming its
request id, and the detail goes to the log only.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from app.logs import request_id_var
from eg2_runtime.errors import (
    CheckpointError,
    EG2Error,
    EngineError,
    InputError,
    InputTooLargeError,
)

log = logging.getLogger("eg2.errors")


class AppError(Exception):
    """An error the service raises on purpose; its message is safe to show a client."""

    def __init__(
        self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class Unauthorized(AppError):
    """Missing or wrong API key."""


class ModelNotFound(AppError):
    """The request names a model this server does not serve."""


class Overloaded(AppError):
    """The admission limit is reached; the client should retry after a while."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after_s)})


class Unavailable(AppError):
    """Loading, draining, timed out, or the engine failed: retry later, perhaps elsewhere."""


class BodyTimeout(AppError):
    """The client did not send its body in time (slow-body defence)."""


class ClientGone(AppError):
    """The client disconnected before its answer was ready; nobody reads the response."""


# The one table. First matching row wins, so subclasses come before their bases.
#   exception class            status  documented name
ERROR_TABLE: tuple[tuple[type[Exception], int, str], ...] = (
    (Unauthorized, 401, "authentication_error"),
    (ModelNotFound, 404, "model_not_found"),
    (BodyTimeout, 408, "request_timeout"),
    (InputTooLargeError, 413, "request_too_large"),  # bytes, items, pixels, duration
    (InputError, 400, "invalid_request_error"),  # malformed, undecodable, modality not loaded, too long
    (Overloaded, 429, "overloaded"),
    (ClientGone, 499, "client_closed_request"),  # never reaches a client; counted in metrics
    (Unavailable, 503, "unavailable"),
    (EngineError, 503, "unavailable"),  # incl. EngineOutOfMemory on a single item after splitting
    (CheckpointError, 503, "unavailable"),
)

INTERNAL_ERROR = "internal_error"


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(status, name) of an exception raised on purpose; None for a bug."""
    for cls, status, name in ERROR_TABLE:
        if isinstance(exc, cls):
            return status, name
    return None


def clip(text: str, limit: int = 64) -> str:
    """A client-sent value cut for an error message: answers stay small whatever was sent (a 30 MB
    `model` field is not sent back), and a pasted secret or payload is not reflected whole."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_body(message: str, name: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": name, "param": param, "code": name}}


def error_response(
    status: int, name: str, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, name, param), status_code=status, headers=headers)


def internal_error_response() -> JSONResponse:
    request_id = request_id_var.get() or "-"
    return error_response(
        500, INTERNAL_ERROR, f"internal error; the server log has the details under request id {request_id}"
    )


def response_for(exc: BaseException) -> JSONResponse:
    """The answer to any exception: its table row, or a generic 500 (logged with its traceback)."""
    row = classify(exc)
    if row is None:
        log.error("unhandled %s while serving a request", type(exc).__name__, exc_info=exc)
        return internal_error_response()
    status, name = row
    if isinstance(exc, AppError | EG2Error):
        message, param = exc.message, exc.param
    else:  # pragma: no cover - every table row is an AppError or an EG2Error
        message, param = str(exc), None
    headers = exc.headers if isinstance(exc, AppError) else None
    return error_response(status, name, message, param=param, headers=headers)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """('input', 2, 'image_url', 'url') -> 'input[2].image_url.url' (the `body` prefix dropped).

    Names are clipped: an unknown field's name is the client's, and may be megabytes long.
    """
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and p.startswith("<"))]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out:
            out += f".{clip(part)}"
        else:
            out = clip(str(part))
    return out or None


def validation_response(errors: list[dict[str, Any]]) -> JSONResponse:
    """400 for a request that does not match the schema, naming the first offending field.

    The offending value is never echoed: it may be megabytes of media, or a secret.
    """
    if not errors:
        return error_response(400, "invalid_request_error", "invalid request")
    first = errors[0]
    param = _param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', message)}"
    elif message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
    if param and first.get("type") != "json_invalid" and not message.startswith(param.split(".")[-1]):
        message = f"{param}: {message}"
    extra = len(errors) - 1
    if extra:
        message += f" (and {extra} more error{'s' if extra > 1 else ''})"
    return error_response(400, "invalid_request_error", message, param=param)


async def _on_app_error(request: Request, exc: Exception) -> JSONResponse:
    return response_for(exc)


async def _on_pydantic(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return validation_response([dict(e) for e in exc.errors(include_url=False, include_input=False)])


async def _on_request_validation(request: Request, exc: Exception) -> JSONResponse:
    # FastAPI's default is 422 with the offending input echoed; the contract says 400, echo nothing.
    assert isinstance(exc, RequestValidationError)
    return validation_response([{k: v for k, v in dict(e).items() if k != "input"} for e in exc.errors()])


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's own 404 (no route) and 405 (wrong method), and HTTPExceptions FastAPI raises.
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {clip(request.method)} {clip(request.url.path)}"
    elif exc.status_code == 405:
        message = f"method {clip(request.method)} not allowed on {clip(request.url.path)}"
    else:
        message = str(exc.detail)
    name = "invalid_request_error" if exc.status_code < 500 else INTERNAL_ERROR
    return error_response(exc.status_code, name, message, headers=dict(exc.headers or {}))


def install_error_handlers(app: FastAPI) -> None:
    """The handlers never read the request body: a BareRoute's errors reach them with the Request the
    app's ExceptionMiddleware built, whose body was not kept (app/bare_route.py)."""
    app.add_exception_handler(AppError, _on_app_error)
    app.add_exception_handler(EG2Error, _on_app_error)
    app.add_exception_handler(ValidationError, _on_pydantic)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(HTTPException, _on_http)
