"""ApiError: a request the server refuses, answered as OpenAI-style error JSON (never a traceback).

Body: {"error": {"message": ..., "type": ..., "param": ..., "code": status}}; `param` names the
request field at fault when there is one.
"""

from __future__ import annotations

from typing import Any

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)
