"""`ApiError`: a request the server refuses, as OpenAI's error body (`param` names the field), and the helpers
every field check shares."""

from __future__ import annotations

import json
from typing import Any

SHOWN_CHARS = 60  # how much of a refused value an error message repeats


class ApiError(Exception):
    """A request the server refuses, as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
                             503: "ServiceUnavailableError"}.get(status, "ServerError")
        self.close = close  # answer with `Connection: close` (the rest of the body was not read)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def shown(value: Any) -> str:
    """A refused value as an error message repeats it: its JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
