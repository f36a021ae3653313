"""The HTTP application (FastAPI): the OpenAI-compatible routes, `/health` and `/metrics`.

Every `/v1/*` request needs `Authorization: Bearer KEY` when the server has an API key (401 otherwise);
`/health` and `/metrics` stay open. Bodies larger than `max_body_bytes` answer 413. Every refusal is an
OpenAI error body (`openai_api.ApiError`).

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
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
    response,
    usage,
    usage_chunk,
)
from mbridge_epoverlap.serving.frontend.text import TextStream

MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class Settings:
    """What the application is told."""

    model: ModelInfo
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES


@dataclass
class _Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    completion_tokens: int = 0


def build_app(settings: Settings, engine: EngineClient, metrics: Any) -> Any:
    """The FastAPI application of one server."""
    app = FastAPI(title="mbridge-epoverlap", docs_url=None, redoc_url=None, openapi_url=None)
    model = settings.model

    def error(exc: ApiError) -> JSONResponse:
        if exc.status == 503:
            metrics.rejected()
        return JSONResponse(exc.body(), status_code=exc.status)

    def authorize(request: Request) -> None:
        if settings.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)")

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise ApiError(413, f"the request body is {declared} bytes, over the limit of {settings.max_body_bytes}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > settings.max_body_bytes:
                raise ApiError(413, f"the request body is over the limit of {settings.max_body_bytes} bytes")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        try:
            authorize(request)
        except ApiError as exc:
            return error(exc)
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "mbridge-epoverlap", "max_model_len": model.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, parse_chat)

    async def generate(request: Request, parse: Callable[[Any, ModelInfo], ParsedRequest]) -> Any:
        try:
            authorize(request)
            parsed = parse(await read_json(request), model)
            streams = submit(parsed)
        except ApiError as exc:
            return error(exc)
        events = follow(parsed, streams)
        if parsed.stream:
            return StreamingResponse(sse(parsed, streams, events), media_type="text/event-stream")
        return await whole(request, parsed, streams, events)

    def submit(parsed: ParsedRequest) -> list[Any]:
        g = parsed.generation
        streams: list[Any] = []
        try:
            for prompt in parsed.prompts:
                streams.append(engine.submit(prompt, max_tokens=g.max_tokens, ignore_eos=g.ignore_eos,
                                             temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, seed=g.seed))
        except Unavailable as exc:
            for stream in streams:
                engine.abort(stream)
            raise ApiError(503, str(exc)) from None
        return streams

    async def follow(parsed: ParsedRequest, streams: list[Any]) -> AsyncIterator[tuple[_Choice, str]]:
        """(choice, new text) as each engine request's tokens arrive, the choice's finish reason set on its last;
        a failure raises ApiError(500) naming the engine's reason."""
        merged: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(index: int, stream: Any) -> None:
            text = TextStream(model.codec, parsed.generation.stop)
            choice = _Choice(index, token_ids=[])
            while True:
                item = await stream.queue.get()
                if isinstance(item, Failure):
                    await merged.put(item)
                    return
                token, finish = item
                choice.token_ids.append(token)
                choice.completion_tokens += 1
                delta = text.add(token)
                if text.stopped:
                    engine.abort(stream, outcome="finished")
                    finish = "stop"
                elif finish is not None:
                    delta += text.finish()
                if finish is not None:
                    choice.finish_reason = finish
                    await merged.put((choice, delta))
                    await merged.put(None)
                    return
                if delta:
                    await merged.put((choice, delta))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                item = await merged.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Failure):
                    raise ApiError(500, f"the request failed: {item.reason}")
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                engine.abort(stream)

    async def sse(parsed: ParsedRequest, streams: list[Any], events: AsyncIterator[tuple[_Choice, str]]
                  ) -> AsyncIterator[str]:
        prompt_tokens = sum(s.prompt_tokens for s in streams)
        counts = [0] * len(streams)
        try:
            if parsed.chat:
                for index in range(len(streams)):
                    yield _event(chunk(parsed, model.name, index, "", None, role=True))
            async for choice, delta in events:
                counts[choice.index] = choice.completion_tokens
                yield _event(chunk(parsed, model.name, choice.index, delta, choice.finish_reason))
            if parsed.include_usage:
                yield _event(usage_chunk(parsed, model.name, usage(prompt_tokens, sum(counts))))
        except ApiError as exc:
            yield _event(exc.body())
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    async def whole(request: Request, parsed: ParsedRequest, streams: list[Any],
                    events: AsyncIterator[tuple[_Choice, str]]) -> Any:
        choices = {i: _Choice(i) for i in range(len(streams))}

        async def collect() -> None:
            async for choice, delta in events:
                mine = choices[choice.index]
                mine.text += delta
                mine.finish_reason, mine.token_ids = choice.finish_reason, choice.token_ids
                mine.completion_tokens = choice.completion_tokens

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
        ordered = [vars(choices[i]) for i in range(len(streams))]
        prompt_tokens = sum(s.prompt_tokens for s in streams)
        completion_tokens = sum(c["completion_tokens"] for c in ordered)
        return response(parsed, model.name, ordered, usage(prompt_tokens, completion_tokens))

    @app.get("/health")
    async def health() -> Any:
        workers = engine.workers()
        state = engine.state
        broken = engine.cannot_serve() if state == READY else None
        if broken is not None:
            return JSONResponse({"status": "unavailable", "reason": broken, "workers": workers}, status_code=503)
        if state == READY:
            status = "ok" if all(w["alive"] for w in workers) else "degraded"
            return {"status": status, "model": model.name, "workers": workers}
        reason = engine.reason or state
        body = {"status": state if state in (STARTING, DRAINING, FAILED) else "unavailable", "reason": reason,
                "workers": workers}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Any:
        engine.workers()  # counts the worker processes lost since the last look
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


async def _disconnected(request: Any) -> None:
    """Return once the client closed the connection (the body was read already, so the next message is it)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
