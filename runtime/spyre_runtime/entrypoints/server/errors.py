"""OpenAI-style errors, the same for every route of every task: the error body, `APIError` (a failed check,
raised anywhere in a route: an OpenAI-style 4xx naming the parameter, or a 5xx), and the app's exception
handlers, which turn schema errors, unknown routes, APIError and anything unexpected into that body."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


def model_not_found(name: str, served_model_name: str) -> APIError:
    """A request for a model this server does not serve."""
    return APIError(
        404,
        f"model {name!r} does not exist; this server serves {served_model_name!r}",
        "model",
        "model_not_found",
    )


def param_of(loc: tuple) -> str | None:
    """A pydantic error location as the request parameter it names: ("body", "messages", 0, "content",
    "str") -> "messages.0.content" (union member tags dropped)."""
    parts = []
    for p in loc:
        if p == "body":
            continue
        if isinstance(p, str) and (p in {"str", "int", "float", "bool", "dict", "list"} or "[" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def extra_field_message(param: str, unsupported: Mapping[str, str]) -> str:
    """An unknown parameter: why it is refused when the served API knows the parameter (`unsupported`:
    parameter -> reason), else that this server does not implement it."""
    top = param.split(".")[0]
    if top in unsupported:
        return f"{top}: {unsupported[top]}"
    return f"{param}: unknown parameter (this server does not implement it)"


def validation_error_body(e: RequestValidationError, unsupported: Mapping[str, str]) -> dict:
    """A request body that does not fit its schema, as a 400 naming the first bad parameter."""
    first = e.errors()[0] if e.errors() else {}
    param = param_of(tuple(first.get("loc", ())))
    kind = first.get("type")
    if kind == "json_invalid":
        param = None
        message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
    elif kind == "extra_forbidden" and param:
        message = extra_field_message(param, unsupported)
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    return error_body(message, "invalid_request_error", param)


def install_error_handlers(app: FastAPI, unsupported: Mapping[str, str]) -> None:
    """Every error of `app` as an OpenAI error body. `unsupported`: the parameters of OpenAI's or vLLM's
    API that the mounted routes know of but refuse, with the reason a 400 gives."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        if e.status == 503:
            kind = "service_unavailable"
        return JSONResponse(error_body(e.message, kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return JSONResponse(validation_error_body(e, unsupported), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unexpected error while handling a request")
        message = f"internal error: {type(e).__name__}: {e}"
        return JSONResponse(error_body(message, "server_error"), status_code=500)
