"""OpenAI's request and response shapes: bodies checked field by field, and the responses and stream chunks.

Checks follow OpenAI's schema and vLLM's behaviour where OpenAI's is silent: an `ApiError` names the field
(`param`) and carries the status (400; 404 for an unknown model) and OpenAI's error body. The context check
refuses a prompt whose tokens and `max_tokens` together exceed the model's context, naming both numbers.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mbridge_epoverlap.serving.frontend.text import NoTokenizer, TextCodec

DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's; chat defaults to the rest of the context


class ApiError(Exception):
    """A request the server refuses, as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             413: "RequestTooLargeError", 503: "ServiceUnavailableError"}.get(status, "ServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ModelInfo:
    """What the checks need of the served model."""

    name: str
    vocab_size: int
    max_model_len: int
    codec: TextCodec


@dataclass(frozen=True)
class Generation:
    """The generation settings of one request (every prompt of it)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class ParsedRequest:
    """A checked request: its prompts as token ids, how to generate, how to answer."""

    prompts: list[list[int]]
    generation: Generation
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def parse_completion(body: Any, model: ModelInfo) -> ParsedRequest:
    """A `/v1/completions` body. Raises ApiError."""
    body = _object(body)
    _check_model(body, model)
    _unsupported(body, ("n", 1), ("best_of", 1), ("echo", False), ("suffix", None), ("logprobs", None))
    prompts = _prompts(body.get("prompt"), model)
    return _parsed(body, model, prompts, default_max=DEFAULT_MAX_TOKENS, chat=False)


def parse_chat(body: Any, model: ModelInfo) -> ParsedRequest:
    """A `/v1/chat/completions` body. Raises ApiError (400 naming the missing template when there is none)."""
    body = _object(body)
    _check_model(body, model)
    _unsupported(body, ("n", 1), ("logprobs", False), ("top_logprobs", None), ("tools", None))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str | None)
            for m in messages):
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\": str, \"content\": str}",
                       param="messages")
    try:
        prompt = model.codec.chat_prompt(messages)
    except NoTokenizer as exc:
        raise ApiError(400, str(exc), param="messages") from None
    except Exception as exc:  # the template itself refused the messages (raise_exception)
        raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from None
    if not prompt:
        raise ApiError(400, "the chat template gave an empty prompt", param="messages")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return _parsed(dict(body, max_tokens=limit), model, [prompt], default_max=None, chat=True)


def _parsed(body: dict[str, Any], model: ModelInfo, prompts: list[list[int]], *, default_max: int | None,
            chat: bool) -> ParsedRequest:
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else model.max_model_len - max(map(len, prompts))
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise ApiError(400, f"'max_tokens' must be an integer of at least 1, got {max_tokens!r}", param="max_tokens")
    for prompt in prompts:
        if len(prompt) + max_tokens > model.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                                f"{'messages' if chat else 'prompt'}, {max_tokens} for the completion). Reduce the "
                                f"prompt or max_tokens.", param="max_tokens" if max_tokens > 1 else "prompt")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise ApiError(400, f"'temperature' must be at least 0, got {temperature}", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < -1:
        raise ApiError(400, f"'top_k' must be an integer, -1 or 0 for all, got {top_k!r}", param="top_k")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    generation = Generation(max_tokens, temperature, top_p, max(top_k, 0), seed, tuple(stops), ignore_eos)
    return ParsedRequest(prompts, generation, bool(stream), bool(options.get("include_usage")), chat)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _check_model(body: dict[str, Any], model: ModelInfo) -> None:
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError(400, "'model' is required: the served model's name (see /v1/models)", param="model")
    if name != model.name:
        raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model.name}`", param="model")


def _unsupported(body: dict[str, Any], *allowed: tuple[str, Any]) -> None:
    """Fields this server does not implement: absent or at their neutral value, else 400 naming the field."""
    for name, neutral in allowed:
        value = body.get(name)
        if value is not None and value != neutral and not (value is False and neutral is None):
            raise ApiError(400, f"'{name}' = {value!r} is not supported by this server (only {neutral!r})",
                           param=name)


def _prompts(prompt: Any, model: ModelInfo) -> list[list[int]]:
    """A prompt as OpenAI allows it: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either",
                       param="prompt")
    out = []
    for item in prompts:
        if isinstance(item, str):
            try:
                ids = model.codec.encode(item)
            except NoTokenizer as exc:
                raise ApiError(400, str(exc), param="prompt") from None
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            ids = list(item)
        else:
            raise ApiError(400, "each 'prompt' must be a string or a non-empty list of token ids", param="prompt")
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary 0..{model.vocab_size - 1}",
                           param="prompt")
        out.append(ids)
    return out


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", param=name)
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- responses ---------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(request: ParsedRequest, model: str, choices: Sequence[dict[str, Any]],
             usage_: dict[str, int]) -> dict[str, Any]:
    """The whole answer; `choices` as (index, text, finish_reason, token_ids) dicts."""
    if request.chat:
        body = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                 "finish_reason": c["finish_reason"], "logprobs": None} for c in choices]
        return {"id": f"chatcmpl-{request.request_id}", "object": "chat.completion", "created": request.created,
                "model": model, "choices": body, "usage": usage_}
    body = [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"], "logprobs": None,
             "token_ids": c["token_ids"]} for c in choices]
    return {"id": f"cmpl-{request.request_id}", "object": "text_completion", "created": request.created,
            "model": model, "choices": body, "usage": usage_}


def chunk(request: ParsedRequest, model: str, index: int, text: str | None, finish_reason: str | None, *,
          role: bool = False) -> dict[str, Any]:
    """One stream event of choice `index`: a text delta (chat: a message delta; `role` for its first)."""
    if request.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        body = {"id": f"chatcmpl-{request.request_id}", "object": "chat.completion.chunk",
                "created": request.created, "model": model, "choices": [choice]}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        body = {"id": f"cmpl-{request.request_id}", "object": "text_completion", "created": request.created,
                "model": model, "choices": [choice]}
    if request.include_usage:
        body["usage"] = None
    return body


def usage_chunk(request: ParsedRequest, model: str, usage_: dict[str, int]) -> dict[str, Any]:
    """The last event before `[DONE]` with `stream_options.include_usage`: no choices, the usage."""
    return {"id": f"{'chatcmpl' if request.chat else 'cmpl'}-{request.request_id}",
            "object": "chat.completion.chunk" if request.chat else "text_completion", "created": request.created,
            "model": model, "choices": [], "usage": usage_}
