"""The HTTP application (FastAPI): the OpenAI-compatible routes, `/health`, `/metrics` and `/openapi.json`.

Every `/v1/*` request needs `Authorization: Bearer KEY` when the server has an API key (401 otherwise);
`/health`, `/metrics` and the schema stay open. Every refusal is an OpenAI error body (`openai_api.ApiError`),
and no exception reaches a client as a traceback (one the routes did not expect answers 500; the log
has the traceback).

Limits are answered, not cut (`connections`): a body larger than `max_body_bytes` answers 413 (read to its end
first when the client said it closes, so that it reads the answer), a body that has not arrived within
`body_timeout_s` answers 408, and past `max_connections` open connections a request answers 503. A body is
read whole before its request reaches the engine, so a slow client never holds a worker's batch; a slow
reader of a stream holds only its own connection (its tokens wait in the front end, at most its
`max_tokens`, while the worker's batch goes on).

A request with several prompts becomes one engine request per prompt, answered as the choices of one
response (their events interleave in a stream, each with its `index`). A stream is server-sent events,
`data: {...}` per text delta and a final `data: [DONE]`; a client that goes away (a stream closed, or a
plain request's connection) aborts its engine requests, and their KV rows are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mbridge_epoverlap.serving.api.choices import ChoiceState, best, sequence_seed
from mbridge_epoverlap.serving.frontend import schema
from mbridge_epoverlap.serving.frontend.connections import ConnectionLimit, client_closes, read_body
from mbridge_epoverlap.serving.frontend.engine_client import (
    DRAINING,
    FAILED,
    READY,
    STARTING,
    EngineClient,
    Failure,
    Unavailable,
)
from mbridge_epoverlap.serving.frontend.openai_api import (
    ApiError,
    ModelInfo,
    ParsedRequest,
    chunk,
    parse_chat,
    parse_completion,
    parse_json,
    response,
    usage,
    usage_chunk,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 1024


@dataclass(frozen=True)
class Settings:
    """What the application is told."""

    model: ModelInfo
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    # What the server runs and why (its layout, measured or from the flags; its compute dtype), reported by `/health`.
    serving: dict[str, Any] = field(default_factory=dict)


def build_app(settings: Settings, engine: EngineClient, metrics: Any,
              open_connections: Callable[[], int] | None = None) -> Any:
    """The FastAPI application of one server; `open_connections` counts the server's open connections (None:
    no limit)."""
    app = FastAPI(title="mbridge-epoverlap", version="1", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    model = settings.model
    if open_connections is not None:
        app.add_middleware(ConnectionLimit, open_connections=open_connections, limit=settings.max_connections,
                           body_timeout_s=settings.body_timeout_s, on_refused=metrics.rejected)

    @app.exception_handler(StarletteHTTPException)
    async def routing(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # No such route, or not with this method: OpenAI's error body too.
        detail = exc.detail if isinstance(exc.detail, str) else "refused"
        return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: {detail}").body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a refusal: the log keeps the traceback, the client gets an error body without it.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(ApiError(500, f"the server failed on this request ({type(exc).__name__}); its log "
                                          "has the details").body(), status_code=500)

    def error(exc: ApiError) -> JSONResponse:
        if exc.status == 503:
            metrics.rejected()
        headers = {"Connection": "close"} if exc.close else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def authorize(request: Request) -> None:
        if settings.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)")

    async def read_json(request: Request) -> Any:
        return parse_json(await read_body(request.receive, request.headers.get("content-length"),
                                          limit=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                                          drain=client_closes(request.scope)))

    @app.get("/v1/models", responses=schema.models_responses())
    async def models(request: Request) -> Any:
        try:
            authorize(request)
        except ApiError as exc:
            return error(exc)
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "mbridge-epoverlap", "max_model_len": model.max_model_len}]}

    @app.post("/v1/completions", openapi_extra=schema.completion_request(model),
              responses=schema.generation_responses())
    async def completions(request: Request) -> Any:
        return await generate(request, parse_completion)

    @app.post("/v1/chat/completions", openapi_extra=schema.chat_request(model),
              responses=schema.generation_responses())
    async def chat_completions(request: Request) -> Any:
        return await generate(request, parse_chat)

    async def generate(request: Request, parse: Callable[[Any, ModelInfo], ParsedRequest]) -> Any:
        try:
            authorize(request)
            parsed = parse(await read_json(request), model)
            streams = submit(parsed)
        except ApiError as exc:
            return error(exc)
        choices = states(parsed)
        events = follow(parsed, streams, choices)
        if parsed.stream:
            return StreamingResponse(sse(parsed, choices, events), media_type="text/event-stream")
        return await whole(request, parsed, choices, events)

    def submit(parsed: ParsedRequest) -> list[Any]:
        """The request's engine sequences: `best_of` per prompt, sequence j seeded with the request's seed + j."""
        g = parsed.generation
        streams: list[Any] = []
        try:
            for prompt in parsed.prompts:
                for j in range(parsed.choices.best_of):
                    streams.append(engine.submit(prompt, max_tokens=g.max_tokens, ignore_eos=g.ignore_eos,
                                                 temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                                 seed=sequence_seed(g.seed, j), options=parsed.options))
        except Unavailable as exc:
            for stream in streams:
                engine.abort(stream)
            raise ApiError(503, str(exc)) from None
        return streams

    def states(parsed: ParsedRequest) -> list[ChoiceState]:
        best_of = parsed.choices.best_of
        return [ChoiceState(k, model.codec, parsed, parsed.prompts[k // best_of])
                for k in range(len(parsed.prompts) * best_of)]

    async def follow(parsed: ParsedRequest, streams: list[Any], choices: list[ChoiceState]
                     ) -> AsyncIterator[tuple[ChoiceState, str, list[Any]]]:
        """(choice, new text, new log-probability entries) as each engine sequence's tokens arrive, the choice's
        finish reason set on its last; a failure raises ApiError(500) naming the engine's reason."""
        merged: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(choice: ChoiceState, stream: Any) -> None:
            pending: list[Any] = []  # entries of tokens whose text is held back: they go with the next text
            while True:
                item = await stream.queue.get()
                if isinstance(item, Failure):
                    await merged.put(item)
                    return
                delta, entries, done = choice.add(*item)
                pending += entries
                if done:
                    if choice.finish_reason is not None and item[1] is None:  # a stop string or a dropped token
                        engine.abort(stream, outcome="finished")
                    await merged.put((choice, delta, pending))
                    await merged.put(None)
                    return
                if delta:
                    await merged.put((choice, delta, pending))
                    pending = []

        tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(choices, streams, strict=True)]
        try:
            left = len(streams)
            while left:
                item = await merged.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Failure):
                    raise ApiError(500, f"the request {parsed.request_id} failed: {item.reason}")
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                engine.abort(stream)

    async def sse(parsed: ParsedRequest, choices: list[ChoiceState],
                  events: AsyncIterator[tuple[ChoiceState, str, list[Any]]]) -> AsyncIterator[str]:
        calls = parsed.tool_choice is not None  # the output is a call's arguments: sent as tool_calls at its end
        try:
            if parsed.chat:
                for choice in choices:
                    yield _event(chunk(parsed, model.name, choice.index, "", None, role=True))
            async for choice, delta, entries in events:
                logprobs = choice.logprobs_of(entries)
                if calls and choice.finish_reason is None:
                    if logprobs is not None:
                        yield _event(chunk(parsed, model.name, choice.index, None, None, logprobs=logprobs))
                    continue
                tool_calls = None
                if calls:
                    delta = None if choice.tool_calls is not None else choice.text
                    tool_calls = [{"index": i, **call} for i, call in enumerate(choice.tool_calls or [])] or None
                yield _event(chunk(parsed, model.name, choice.index, delta, choice.finish_reason, logprobs=logprobs,
                                   tool_calls=tool_calls))
            if parsed.include_usage:
                completion = sum(c.completion_tokens for c in choices)
                yield _event(usage_chunk(parsed, model.name, usage(_prompt_tokens(parsed), completion)))
        except ApiError as exc:
            yield _event(exc.body())
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    async def whole(request: Request, parsed: ParsedRequest, choices: list[ChoiceState],
                    events: AsyncIterator[tuple[ChoiceState, str, list[Any]]]) -> Any:
        async def collect() -> None:
            async for _ in events:
                pass

        work = asyncio.create_task(collect())
        gone = asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: abort (the events' cleanup frees the engine requests)
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                return Response(status_code=499)
            work.result()
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        finally:
            gone.cancel()
        kept = best(choices, parsed.choices.best_of, parsed.choices.n)
        completion_tokens = sum(c.completion_tokens for c in choices)
        return response(parsed, model.name, [c.answer(i) for i, c in enumerate(kept)],
                        usage(_prompt_tokens(parsed), completion_tokens))

    @app.get("/health", responses=schema.health_responses())
    async def health() -> Any:
        workers = engine.workers()
        state = engine.state
        broken = engine.cannot_serve() if state == READY else None
        if broken is not None:
            return JSONResponse({"status": "unavailable", "reason": broken, "workers": workers}, status_code=503)
        if state == READY:
            status = "ok" if all(w["alive"] for w in workers) else "degraded"
            return {"status": status, "model": model.name, "workers": workers, **settings.serving,
                    "memory": engine.memory_now()}
        reason = engine.reason or state
        body = {"status": state if state in (STARTING, DRAINING, FAILED) else "unavailable", "reason": reason,
                "workers": workers}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics", responses=schema.metrics_responses())
    async def prometheus() -> Any:
        engine.workers()  # counts the worker processes lost since the last look
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


def _prompt_tokens(parsed: ParsedRequest) -> int:
    """The request's prompt tokens, each prompt counted once (its `n` choices share it)."""
    return sum(len(prompt) for prompt in parsed.prompts)


async def _disconnected(request: Any) -> None:
    """Return once the client closed the connection (the body was read already, so the next message is it)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
