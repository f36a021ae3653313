"""The OpenAPI description of the server's routes: the request bodies with the limits `openai_api` checks, and
the answers (OpenAI's error body for every refusal).

The routes read their bodies themselves (`openai_api.parse_json` and the field checks answer OpenAI's error
bodies with 400, where FastAPI's own validation would answer 422), so FastAPI cannot derive the bodies from
the handlers: `app.build_app` attaches these with `openapi_extra`. They are made per server, with the served
model's name, vocabulary and context in them, so that a client generating requests from the schema (the fuzz
test, `benchmarks/api_fuzz.py`) reaches the engine rather than a 404.

The schema is never looser than the checks: a body it refuses, the server refuses (a 4xx). The checks are
stricter in what a schema cannot state: a prompt's tokens and `max_tokens` within the context, a prompt that
encodes to no token, a chat template that refuses the messages.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.memory import KINDS
from mbridge_epoverlap.serving.api.decode_fields import (
    BIAS_LIMIT,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    PENALTY_LIMIT,
)
from mbridge_epoverlap.serving.frontend.openai_api import (
    SEED_MAX,
    SEED_MIN,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ModelInfo,
)

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}},
    }},
}

_REFUSALS = {
    400: "a field is missing, of the wrong type or out of range (`param` names it), or the body is not JSON",
    401: "the server has an API key and the request did not give it (`Authorization: Bearer KEY`)",
    404: "the model named is not the one this server serves",
    408: "the request body did not arrive within the server's body timeout",
    413: "the request body is over the server's limit",
    500: "the engine failed under the request (the message names the worker, or the request)",
    503: "the server is starting, draining or failed, too many requests wait, or too many connections are open",
}


def _errors(*statuses: int) -> dict[int | str, Any]:
    return {status: {"description": _REFUSALS[status], "content": {"application/json": {"schema": ERROR}}}
            for status in statuses}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [{"type": "null"}, schema]}


def _unsupported(fields: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    return {name: {"enum": [None, *neutral], "description": "not implemented: null or the neutral value"}
            for name, neutral in fields.items()}


def _generation(model: ModelInfo, limit_fields: tuple[str, ...]) -> dict[str, Any]:
    """The generation fields both routes share."""
    limit = {"type": "integer", "minimum": 1, "maximum": model.max_model_len - 1,
             "description": f"new tokens at most; with the prompt's within the context of {model.max_model_len}"}
    return {
        **{name: _nullable(limit) for name in limit_fields},
        "temperature": _nullable({"type": "number", "minimum": 0, "description": "0: greedy"}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "description": "-1 or 0: every token"}),
        "seed": _nullable({"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX,
                           "description": "the request's own generator's 64-bit seed"}),
        "stop": {"anyOf": [{"type": "null"}, {"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "ignore_eos": {"type": "boolean"},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": _nullable({"type": "object",
                                     "properties": {"include_usage": {"type": ["boolean", "null"]}}}),
    }


def _decoding(model: ModelInfo) -> dict[str, Any]:
    """The decoding fields both routes share (`api.decode_fields`); `repetition_penalty`, `min_tokens` and
    `stop_token_ids` (with `top_k` and `ignore_eos` above) are vLLM's extensions of OpenAI's API."""
    penalty = _nullable({"type": "number", "minimum": -PENALTY_LIMIT, "maximum": PENALTY_LIMIT})
    count = _nullable({"type": "integer", "minimum": 1, "maximum": max(1, model.max_sequences or 1 << 20),
                       "description": "sequences per prompt (best_of times the prompts within what the server "
                                      "decodes at once)"})
    token = {"type": "integer", "minimum": 0, "maximum": model.vocab_size - 1}
    grammar = {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"],
         "properties": {"type": {"const": "json_schema"},
                        "json_schema": {"type": "object", "required": ["schema"],
                                        "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                       "strict": {"type": ["boolean", "null"]}}}}}]}
    return {
        "n": count,
        "presence_penalty": penalty,
        "frequency_penalty": penalty,
        "repetition_penalty": _nullable({"type": "number", "minimum": MIN_REPETITION_PENALTY,
                                         "maximum": MAX_REPETITION_PENALTY, "description": "vLLM's: 1 none"}),
        "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,12}$"},
                                 "additionalProperties": {"type": "number", "minimum": -BIAS_LIMIT,
                                                          "maximum": BIAS_LIMIT},
                                 "description": "token id (in the vocabulary) -> bias added to its logit"}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0, "description": "vLLM's: at most max_tokens"}),
        "stop_token_ids": _nullable({"type": "array", "items": token, "description": "vLLM's"}),
        "response_format": _nullable(grammar),
        "user": {"type": ["string", "null"]},
    }


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def completion_request(model: ModelInfo) -> dict[str, Any]:
    """`openapi_extra` of `POST /v1/completions`."""
    tokens = {"type": "array", "minItems": 1,
              "items": {"type": "integer", "minimum": 0, "maximum": model.vocab_size - 1}}
    prompt = {"anyOf": [{"type": "string"}, tokens,
                        {"type": "array", "minItems": 1, "items": {"anyOf": [{"type": "string"}, tokens]}}],
              "description": "text, token ids, or a list of either (one choice each)"}
    return _json_body({
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {"model": {"type": "string", "enum": [model.name]}, "prompt": prompt,
                       **_generation(model, ("max_tokens",)), **_decoding(model),
                       "max_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": model.max_model_len - 1,
                                                "description": "new tokens at most (0 with echo: the prompt alone)"}),
                       "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": model.max_logprobs}),
                       "echo": {"type": ["boolean", "null"]},
                       "best_of": _decoding(model)["n"],
                       **_unsupported(UNSUPPORTED_COMPLETION)},
    })


_TOOL = {"type": "object", "required": ["type", "function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string", "minLength": 1},
                                                    "description": {"type": "string"},
                                                    "parameters": {"type": "object"}}}}}


def chat_request(model: ModelInfo) -> dict[str, Any]:
    """`openapi_extra` of `POST /v1/chat/completions`."""
    message = {"type": "object", "required": ["role"],
               "properties": {"role": {"type": "string"}, "content": {"type": ["string", "null"]}}}
    return _json_body({
        "type": "object",
        "required": ["model", "messages"],
        "properties": {"model": {"type": "string", "enum": [model.name]},
                       "messages": {"type": "array", "minItems": 1, "items": message},
                       **_generation(model, ("max_tokens", "max_completion_tokens")), **_decoding(model),
                       "logprobs": {"type": ["boolean", "null"]},
                       "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": model.max_logprobs}),
                       "tools": _nullable({"type": "array", "minItems": 1, "items": _TOOL}),
                       "tool_choice": _nullable({"anyOf": [
                           {"enum": ["none", "required", "auto"], "description": "auto is refused (400)"},
                           {"type": "object", "required": ["type", "function"],
                            "properties": {"type": {"const": "function"},
                                           "function": {"type": "object", "required": ["name"],
                                                        "properties": {"name": {"type": "string"}}}}}]}),
                       "parallel_tool_calls": {"type": ["boolean", "null"]},
                       **_unsupported(UNSUPPORTED_CHAT)},
    })


_CHOICES = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "choices": {"type": "array"}, "usage": {"type": "object"}}}


_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def generation_responses() -> dict[int | str, Any]:
    """The answers of both generation routes: JSON, or server-sent events with `"stream": true`."""
    return {200: {"description": "the completion, or its events (`data: {...}` lines, then `data: [DONE]`)",
                  "content": {"application/json": {"schema": _CHOICES},
                              # OpenAPI 3.1: an event stream's schema describes each event
                              "text/event-stream": {"schema": _EVENT}}},
            **_errors(400, 401, 404, 408, 413, 500, 503)}


def models_responses() -> dict[int | str, Any]:
    listing = {"type": "object", "required": ["object", "data"],
               "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                   "type": "object", "required": ["id", "object", "max_model_len"],
                   "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                  "max_model_len": {"type": "integer"}}}}}}
    return {200: {"description": "the served model", "content": {"application/json": {"schema": listing}}},
            **_errors(401, 503)}


# What the worker processes hold, in bytes (`mbridge_epoverlap.memory.total`).
_MEMORY = {"type": "object", "required": ["weights", "kv_cache", "runtime", "rss", "peak_rss"],
           "properties": {"weights": {"type": "object", "description": "resident weight bytes by kind",
                                      "properties": {k: {"type": "integer"} for k in KINDS},
                                      "additionalProperties": {"type": "integer"}},
                          "kv_cache": {"type": "integer"}, "runtime": {"type": "integer"},
                          "rss": {"type": "integer"}, "peak_rss": {"type": "integer"},
                          "peak_over_held": _nullable({"type": "number"}), "processes": {"type": "array"}}}


def health_responses() -> dict[int | str, Any]:
    health = {"type": "object", "required": ["status", "workers"],
              "properties": {"status": {"type": "string"}, "reason": {"type": "string"},
                             "workers": {"type": "array"}, "layout": {"type": "object"},
                             "dtype": {"type": "object"}, "memory": _nullable(_MEMORY)}}
    return {200: {"description": "serving (`ok`, or `degraded` after a worker loss the engine survived)",
                  "content": {"application/json": {"schema": health}}},
            # The connection limit answers every route with OpenAI's error body.
            503: {"description": "starting, draining, failed or unable to serve, or too many connections open",
                  "content": {"application/json": {"schema": {"anyOf": [health, ERROR]}}}}}


def metrics_responses() -> dict[int | str, Any]:
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {200: {"description": "Prometheus text exposition", "content": text}, **_errors(503)}
