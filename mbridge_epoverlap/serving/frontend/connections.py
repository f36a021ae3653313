"""The server's connections: how a body is read, how many connections may be open, how long one may dawdle.

uvicorn bounds none of these, and each is a way for one client to hold what others need:

- `read_body`: a request body within a size and a time limit. One over the size answers 413 as soon as
  that is known (from its Content-Length, or as it arrives), and uvicorn reads and drops the rest while the
  connection stays open; but a client that said it closes (`Connection: close`, as urllib says, or HTTP/1.0)
  has its body read to its end first (up to `DISCARD_BYTES`): uvicorn closes such a connection right after
  the answer, and a client still sending would find it reset before reading the 413. A body that has not
  arrived in time answers 408 and the connection closes.
- `ConnectionLimit`: ASGI middleware; past `limit` open connections a request answers 503 (OpenAI's error
  body), by the same rule.
- `guarded_h11`: uvicorn's h11 protocol that closes a connection which has not sent a whole request head
  within a time limit of opening (or of its last answer): an idle or trickling connection does not keep a
  slot of the limit forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from mbridge_epoverlap.serving.frontend.openai_api import ApiError

DISCARD_BYTES = 64 << 20  # an over-limit body up to this size is read (and dropped) so its 413 can be read

Receive = Callable[[], Awaitable[dict[str, Any]]]


def client_closes(scope: dict[str, Any]) -> bool:
    """Whether the client said it closes the connection after this request (uvicorn then closes it at once)."""
    if scope.get("http_version") == "1.0":
        return True
    return any(name == b"connection" and b"close" in value.lower() for name, value in scope.get("headers", ()))


async def read_body(receive: Receive, declared: str | None, *, limit: int, timeout_s: float,
                    drain: bool = False) -> bytes:
    """The request body from ASGI `receive`; `declared`: its Content-Length header, if any; `drain`: read an
    over-limit body to its end before answering (`client_closes`).

    Raises:
        ApiError: 413 over `limit` bytes, 408 not arrived within `timeout_s`, 400 the client left first.
    """
    if declared is not None and declared.isdigit() and int(declared) > DISCARD_BYTES:
        raise ApiError(413, f"the request body is {declared} bytes, over the limit of {limit}", close=True)
    try:
        return await asyncio.wait_for(_read(receive, declared, limit, drain), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s (the server's "
                            "--read-timeout); send it at once", close=True) from None


async def _read(receive: Receive, declared: str | None, limit: int, drain: bool) -> bytes:
    body = bytearray()
    size = 0
    over = declared is not None and declared.isdigit() and int(declared) > limit
    if over and not drain:
        raise ApiError(413, f"the request body is {declared} bytes, over the limit of {limit}")
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "the client closed the connection before its request body arrived")
        part = message.get("body", b"")
        size += len(part)
        over = over or size > limit
        if over and not drain:
            raise ApiError(413, f"the request body is more than {limit} bytes, over the limit")
        if not over:
            body += part
        if size > DISCARD_BYTES:
            raise ApiError(413, f"the request body is more than {size} bytes, over the limit of {limit}", close=True)
        if not message.get("more_body", False):
            break
    if over:
        raise ApiError(413, f"the request body is {size} bytes, over the limit of {limit}")
    return bytes(body)


class ConnectionLimit:
    """ASGI middleware: a request on a server with more than `limit` open connections answers 503.

    Args:
        app: the application.
        open_connections: the number of open connections (this request's among them).
        limit: most connections served.
        body_timeout_s: how long a refused request's body is waited for.
        on_refused: called for each refused request (the metrics' rejected count).
    """

    def __init__(self, app: Any, *, open_connections: Callable[[], int], limit: int, body_timeout_s: float,
                 on_refused: Callable[[], None]) -> None:
        self.app, self.open_connections, self.limit = app, open_connections, limit
        self.body_timeout_s, self.on_refused = body_timeout_s, on_refused

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        open_now = self.open_connections()
        if open_now <= self.limit:
            await self.app(scope, receive, send)
            return
        self.on_refused()
        declared = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1") or None
        if client_closes(scope):  # else uvicorn reads and drops the body after the answer
            with contextlib.suppress(ApiError):  # its size and arrival do not matter: it is refused either way
                await read_body(receive, declared, limit=DISCARD_BYTES, timeout_s=self.body_timeout_s, drain=True)
        error = ApiError(503, f"the server has {open_now} connections open, over its limit of {self.limit} "
                              "(--max-connections); retry later")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def guarded_h11(head_timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request head has not arrived within `head_timeout_s`
    of its opening or of its last answer (given to `uvicorn.Config(http=...)`)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._expect_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._expect_head()

        def _expect_head(self) -> None:
            waiting = self.cycle  # a new request head replaces the cycle

            def expire() -> None:
                if self.cycle is waiting and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(head_timeout_s, expire)

    return GuardedH11
