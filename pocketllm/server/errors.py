"""Error responses in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import Any

from fastapi import responses

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 500: "server_error", 503: "service_unavailable", 504: "timeout",
               505: "invalid_request_error"}


class JSONResponse(responses.JSONResponse):
    """A JSON response that is always valid UTF-8: content holding a lone surrogate (a request's field name
    echoed in an error, say) is written with its non-ASCII characters escaped."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)
