"""OpenAI-style JSON errors: `{"error": {"message", "type", "param", "code"}}`, `param` naming the field."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def field_name(loc) -> str:
    """pydantic's location (`("body", "tools", 0, "function", "name")`) as `tools[0].function.name`."""
    name = ""
    for part in loc:
        if part == "body" and not name:
            continue
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


async def api_error(_: Request, error: APIError) -> JSONResponse:
    return error.response()


async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    # A union field reports the failing member's name last (e.g. `...content.str`): keep the request's path.
    loc = [p for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in {"str", "list", "int"}))]
    param = field_name(loc)
    return APIError(400, f"{param}: {first['msg']}", param, "invalid_value").response()


def install(app) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
