"""OpenAI's request and response shapes: bodies checked field by field, and the responses and stream chunks.

Checks follow OpenAI's schema and vLLM's behaviour where OpenAI's is silent: an `ApiError` names the field
(`param`) and carries the status (400; 404 for an unknown model) and OpenAI's error body. The context check
refuses a prompt whose tokens and `max_tokens` together exceed the model's context, naming both numbers.

Nothing a worker cannot honour gets past these checks (a worker that failed on a request would take every
request it holds with it): the body is strict JSON (no NaN or Infinity, every number finite, integers of at
most `MAX_DIGITS` digits, nesting within the parser's depth), every string in it is text (no lone UTF-16
surrogate, which the tokenizer refuses), a seed fits the generator (`SEED_MIN`..`SEED_MAX`), token ids fit
the vocabulary, a temperature too small to divide the logits by decodes greedily (`GREEDY_BELOW`) and a top_p
too small for float32 is raised to one that keeps the same token (`TOP_P_FLOOR`). The OpenAPI schema the
server publishes (`schema`) states the same limits.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mbridge_epoverlap.serving.api import decode_fields, tools
from mbridge_epoverlap.serving.api.decode_fields import Choices
from mbridge_epoverlap.serving.api.errors import SHOWN_CHARS, ApiError, is_int, shown
from mbridge_epoverlap.serving.api.served_model import ModelInfo
from mbridge_epoverlap.serving.api.tools import ToolChoice
from mbridge_epoverlap.serving.decoding.options import DecodeOptions
from mbridge_epoverlap.serving.frontend.text import NoTokenizer

DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's; chat defaults to the rest of the context
# torch.Generator.manual_seed's range: a 64-bit seed, a negative one taken modulo 2**64; one past either end
# raised in the worker and ended it.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# A temperature below this decodes greedily, as vLLM's (its _SAMPLING_EPS): the logits are divided by it in
# float32, where 1e-300 is 0 and the quotient inf, whose softmax is NaN (the worker's sampler raised).
GREEDY_BELOW = 1e-5
# The sampler keeps a token while the probability before it is below top_p, in float32, where a top_p under
# ~1e-45 is 0 and drops every token (the multinomial then raised in the worker). Any top_p under 1/vocab keeps
# just the most likely token, so one below this is raised to it: the same tokens, for vocabularies up to 1e9.
TOP_P_FLOOR = 1e-9
MAX_DIGITS = 4300  # Python's own limit on int(str); longer integers are refused, not converted
# Fields of OpenAI's API this server does not implement: absent, null, or one of these neutral values.
UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {"suffix": ()}
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "audio": (), "modalities": (["text"],), "prediction": (), "functions": (), "function_call": ("none",),
    "reasoning_effort": (), "web_search_options": (), "store": (False,), "service_tier": ("auto", "default"),
    "metadata": ({},)}


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
    options: DecodeOptions | None = None  # every sequence's decoding options beyond the sampling settings
    choices: Choices = Choices()
    tool_choice: ToolChoice | None = None  # chat: how the output becomes tool calls
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def parse_json(raw: bytes) -> Any:
    """A request body as strict JSON (RFC 8259: no NaN or Infinity), every number finite, every string text.

    Raises:
        ApiError: 400 naming what is wrong (and the field, for a string that is not text).
    """
    try:
        body = json.loads(raw, parse_constant=_not_json, parse_float=_finite, parse_int=_integer_text)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and the refusals above
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    where = _not_text(body)
    if where is not None:
        field = where.split(".", 1)[0].split("[", 1)[0]
        field = field if isinstance(body, dict) and field in body else None
        raise ApiError(400, f"{where or 'the body'} is not valid Unicode text (it holds a lone UTF-16 surrogate); "
                            "send UTF-8 text", param=field)
    return body


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:SHOWN_CHARS]} is out of range")
    return value


def _integer_text(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits is out of range (at most {MAX_DIGITS})")
    return int(text)


def _not_text(body: Any) -> str | None:
    """Where in `body` the first string (a key or a value) that is not encodable text is ("messages[0].content"),
    or None; "" for the body itself. Iterative: the parser's nesting depth is not this function's stack."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return where
        elif isinstance(value, dict):
            for key in reversed(list(value)):  # reversed onto the stack: the first field is looked at first
                if not _is_text(key):
                    return f"the key {ascii(key)}" + (f" in {where}" if where else "")
                stack.append((value[key], f"{where}.{key}" if where else key))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in reversed(list(enumerate(value))))
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_completion(body: Any, model: ModelInfo) -> ParsedRequest:
    """A `/v1/completions` body. Raises ApiError."""
    body = _object(body)
    _check_model(body, model)
    _unsupported(body, UNSUPPORTED_COMPLETION)
    prompts = _prompts(body.get("prompt"), model)
    return _parsed(body, model, prompts, default_max=DEFAULT_MAX_TOKENS, chat=False)


def parse_chat(body: Any, model: ModelInfo) -> ParsedRequest:
    """A `/v1/chat/completions` body. Raises ApiError (400 naming the missing template when there is none)."""
    body = _object(body)
    _check_model(body, model)
    _unsupported(body, UNSUPPORTED_CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str | None)
            for m in messages):
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\": str, \"content\": str}",
                       param="messages")
    tool_list, tool_choice = tools.parse(body)
    if tool_choice is not None and body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "'response_format' cannot be given with a 'tool_choice' that calls a tool: the call's "
                            "arguments are the output", param="response_format")
    try:
        prompt = model.codec.chat_prompt(messages, tool_list)
    except NoTokenizer as exc:
        raise ApiError(400, str(exc), param="messages") from None
    except Exception as exc:  # the template itself refused the messages (raise_exception)
        raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from None
    if not prompt:
        raise ApiError(400, "the chat template gave an empty prompt", param="messages")
    # OpenAI's newer name rules where both are given; each given one is checked.
    parsed = _parsed(body, model, [prompt], default_max=None, chat=True,
                     limit_fields=("max_completion_tokens", "max_tokens"))
    if tool_choice is None:
        return parsed
    decode_fields.check_grammar(tool_choice.grammar, model, "tools")
    options = replace(parsed.options or DecodeOptions(), grammar=tool_choice.grammar)
    return replace(parsed, options=options, tool_choice=tool_choice)


def _max_tokens(body: dict[str, Any], model: ModelInfo, prompts: list[list[int]], *, default_max: int | None,
                chat: bool, limit_fields: tuple[str, ...]) -> int:
    """The completion's token limit: the first of `limit_fields` given, else `default_max`, else the rest of
    the context; every one given is an integer of at least 1 that fits the context with each prompt."""
    where = "messages" if chat else "prompt"
    chosen = None
    for name in limit_fields:
        value = body.get(name)
        if value is None:
            continue
        if value == 0 and is_int(value) and body.get("echo") is True:
            value = 1  # the prompt's records alone: one token is generated and dropped (`Choices.prompt_only`)
        if not is_int(value) or value < 1:
            least = "1 (0 with 'echo': the prompt alone)" if not chat else "1"
            raise ApiError(400, f"'{name}' must be an integer of at least {least}, got {shown(value)}", param=name)
        _fits(model, prompts, value, name, where)
        chosen = value if chosen is None else chosen
    if chosen is not None:
        return chosen
    if default_max is None:
        longest = max(map(len, prompts))
        if longest >= model.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {model.max_model_len} tokens. However, the "
                                f"{where} are {longest} tokens, leaving none for the completion. Reduce the {where}.",
                           param=where)
        return model.max_model_len - longest
    _fits(model, prompts, default_max, limit_fields[0], where)
    return default_max


def _fits(model: ModelInfo, prompts: list[list[int]], max_tokens: int, field: str, where: str) -> None:
    for prompt in prompts:
        if len(prompt) + max_tokens > model.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the {where}, "
                                f"{max_tokens} for the completion). Reduce the {where} or {field}.",
                           param=field if max_tokens > 1 else where)


def _parsed(body: dict[str, Any], model: ModelInfo, prompts: list[list[int]], *, default_max: int | None,
            chat: bool, limit_fields: tuple[str, ...] = ("max_tokens",)) -> ParsedRequest:
    max_tokens = _max_tokens(body, model, prompts, default_max=default_max, chat=chat, limit_fields=limit_fields)
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise ApiError(400, f"'temperature' must be at least 0, got {temperature}", param="temperature")
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_p = max(top_p, TOP_P_FLOOR)
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not is_int(top_k) or top_k < -1:
        raise ApiError(400, f"'top_k' must be an integer, -1 or 0 for all, got {shown(top_k)}", param="top_k")
    seed = body.get("seed")
    if seed is not None and not (is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise ApiError(400, f"'seed' must be an integer from -2**63 to 2**64 - 1 (a 64-bit seed), got {shown(seed)}",
                       param="seed")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, f"'ignore_eos' must be a boolean, got {shown(ignore_eos)}", param="ignore_eos")
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise ApiError(400, f"'stream' must be a boolean, got {shown(stream)}", param="stream")
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ApiError(400, f"'stream_options' must be an object, got {shown(options)}", param="stream_options")
    include_usage = options.get("include_usage")
    if not isinstance(include_usage, bool | None):
        raise ApiError(400, f"'stream_options.include_usage' must be a boolean, got {shown(include_usage)}",
                       param="stream_options")
    # top_k at or past the vocabulary keeps every token, as 0 does (and a huge integer never reaches torch.topk)
    top_k = 0 if top_k < 0 or top_k >= model.vocab_size else top_k
    generation = Generation(max_tokens, temperature, top_p, top_k, seed, tuple(stops), ignore_eos)
    user = body.get("user")
    if not isinstance(user, str | None):
        raise ApiError(400, f"'user' must be a string, got {shown(user)}", param="user")
    options, choices = decode_fields.parse(body, model, prompts, chat=chat, max_tokens=max_tokens)
    return ParsedRequest(prompts, generation, options, choices, None, bool(stream), bool(include_usage), chat)


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


def _unsupported(body: dict[str, Any], fields: dict[str, tuple[Any, ...]]) -> None:
    """Fields this server does not implement: absent, null or a neutral value, else 400 naming the field (a
    boolean is not a number here, as in JSON: `"n": true` is refused)."""
    for name, neutral in fields.items():
        value = body.get(name)
        if value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            continue
        allowed = " or ".join(json.dumps(v) for v in (None, *neutral))
        raise ApiError(400, f"'{name}' = {shown(value)} is not supported by this server (only {allowed})",
                       param=name)


def _prompts(prompt: Any, model: ModelInfo) -> list[list[int]]:
    """A prompt as OpenAI allows it: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
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
        elif isinstance(item, list) and item and all(is_int(t) for t in item):
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
    """A finite number field (an integer too large for a float is out of range, not an OverflowError)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{name}' must be a number, got {shown(value)}", param=name)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ApiError(400, f"'{name}' = {shown(value)} is out of range (a finite number)", param=name)
    return number


# --- responses ---------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(request: ParsedRequest, model: str, choices: Sequence[dict[str, Any]],
             usage_: dict[str, int]) -> dict[str, Any]:
    """The whole answer; `choices` as dicts of index, text, finish_reason, token_ids, logprobs (OpenAI's object or
    None) and, in chat, tool_calls (None: a text answer)."""
    if request.chat:
        body = []
        for c in choices:
            message: dict[str, Any] = {"role": "assistant", "content": c["text"]}
            if c.get("tool_calls") is not None:
                message = {"role": "assistant", "content": None, "tool_calls": c["tool_calls"]}
            body.append({"index": c["index"], "message": message, "finish_reason": c["finish_reason"],
                         "logprobs": c.get("logprobs")})
        return {"id": f"chatcmpl-{request.request_id}", "object": "chat.completion", "created": request.created,
                "model": model, "choices": body, "usage": usage_}
    body = [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
             "logprobs": c.get("logprobs"), "token_ids": c["token_ids"]} for c in choices]
    return {"id": f"cmpl-{request.request_id}", "object": "text_completion", "created": request.created,
            "model": model, "choices": body, "usage": usage_}


def chunk(request: ParsedRequest, model: str, index: int, text: str | None, finish_reason: str | None, *,
          role: bool = False, logprobs: dict[str, Any] | None = None,
          tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One stream event of choice `index`: a text delta (chat: a message delta; `role` for its first), with the
    log-probabilities of the tokens it carries and (chat) its tool-call deltas."""
    if request.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason,
                                  "logprobs": logprobs}
        body = {"id": f"chatcmpl-{request.request_id}", "object": "chat.completion.chunk",
                "created": request.created, "model": model, "choices": [choice]}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
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
