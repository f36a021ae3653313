"""The request fields that change how tokens are chosen or what is reported of them, checked as OpenAI and vLLM
define them: `logprobs`, `top_logprobs` and `echo`; `n` and `best_of`; `presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `logit_bias`, `min_tokens`, `stop_token_ids`; `response_format`. Each refusal is a 400
naming the field (`openai_api.ApiError`), before anything reaches a worker; what passes becomes the sequences'
`DecodeOptions` and the request's `Choices`.

Limits: `logprobs` and `top_logprobs` up to the server's `--max-logprobs` (vLLM's default 20); penalties in
OpenAI's ranges (presence and frequency -2..2, a logit bias -100..100) and a repetition penalty from
`MIN_REPETITION_PENALTY` to `MAX_REPETITION_PENALTY`; `n` up to `best_of`, and `best_of` times the prompts within
what the server holds at once (`ModelInfo.max_sequences`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbridge_epoverlap.serving.api.errors import ApiError, is_int, shown
from mbridge_epoverlap.serving.api.served_model import ModelInfo
from mbridge_epoverlap.serving.decoding.options import DecodeOptions

# vLLM takes any positive repetition penalty; a seen logit is divided by it, and 5e-324 made it infinite (the
# sampler's softmax then NaN). Within these bounds a float32 logit stays finite, and a larger penalty than the
# top one already flattens every seen logit to ~0.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0
PENALTY_LIMIT = 2.0  # OpenAI's range of presence_penalty and frequency_penalty
BIAS_LIMIT = 100.0  # OpenAI's range of a logit_bias value
MAX_SCHEMA_CHARS = 64_000  # a JSON schema's text at most (llguidance's own limits apply too)


@dataclass(frozen=True)
class Choices:
    """How many choices a request's prompt gets and what each reports.

    Attributes:
        n: choices returned per prompt.
        best_of: sequences generated per prompt; the `n` of highest cumulative log-probability are returned.
        logprobs: log-probabilities the client asked for (completions: `logprobs` k; chat: `top_logprobs` k
            with `logprobs` true); None: none.
        echo: completions: the prompt's text (and, with `logprobs`, its tokens' records) before each choice's.
        prompt_only: `max_tokens` 0 with `echo`: the prompt's records alone, no token generated.
    """

    n: int = 1
    best_of: int = 1
    logprobs: int | None = None
    echo: bool = False
    prompt_only: bool = False


def parse(body: dict[str, Any], model: ModelInfo, prompts: list[list[int]], *, chat: bool,
          max_tokens: int) -> tuple[DecodeOptions | None, Choices]:
    """The decoding options every sequence of the request gets (None: none) and its choices. Raises ApiError."""
    logprobs, echo = _logprobs(body, model, chat)
    n = _count(body, "n", 1)
    best_of = _count(body, "best_of", n) if not chat else n
    if best_of < n:
        raise _refused(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if best_of > n and body.get("stream"):
        raise _refused("'best_of' above 'n' cannot stream: the best choices are known only at the end", "best_of")
    if model.max_sequences and best_of * len(prompts) > model.max_sequences:
        field = "best_of" if best_of > n else "n"
        raise _refused(f"'{field}' = {best_of} sequences for each of {len(prompts)} prompts is more than the "
                     f"{model.max_sequences} this server decodes at once", field)
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    if not is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise _refused(f"'min_tokens' must be an integer from 0 to max_tokens ({max_tokens}), got {shown(min_tokens)}",
                     "min_tokens")
    grammar = response_format(body, model)
    options = DecodeOptions(
        # best_of > n ranks the sequences by their cumulative log-probability: each reports its tokens'
        logprobs=logprobs if logprobs is not None else (0 if best_of > n else None),
        prompt_logprobs=logprobs if echo and logprobs is not None else None,
        presence_penalty=_ranged(body, "presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        frequency_penalty=_ranged(body, "frequency_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        repetition_penalty=_repetition(body),
        logit_bias=_logit_bias(body, model),
        min_tokens=min_tokens,
        stop_token_ids=_token_ids(body, "stop_token_ids", model),
        grammar=grammar,
    )
    if grammar is not None and body.get("ignore_eos"):
        raise _refused("'ignore_eos' cannot be true with a grammar: the grammar ends with the end-of-sequence token",
                     "ignore_eos")
    prompt_only = echo and body.get("max_tokens") == 0
    return (options if options.to_wire() else None), Choices(n, best_of, logprobs, echo, prompt_only)


def response_format(body: dict[str, Any], model: ModelInfo) -> tuple[str, str] | None:
    """`response_format` as a grammar (kind, schema JSON text), checked with llguidance; None for text."""
    from mbridge_epoverlap.serving.decoding.grammar import JSON_OBJECT, JSON_SCHEMA

    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        grammar = (JSON_OBJECT, "")
    elif kind == JSON_SCHEMA:
        spec = fmt.get(JSON_SCHEMA)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _refused("'response_format.json_schema.schema' must be a JSON schema (an object)", "response_format")
        grammar = (JSON_SCHEMA, json.dumps(schema))
    else:
        raise _refused("'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got "
                       f"{shown(kind)}", "response_format")
    check_grammar(grammar, model, "response_format")
    return grammar


def check_grammar(grammar: tuple[str, str], model: ModelInfo, field: str) -> None:
    """Raise ApiError (400 naming `field`) if llguidance cannot make `grammar` for this model."""
    from mbridge_epoverlap.serving.decoding.grammar import GrammarError

    if len(grammar[1]) > MAX_SCHEMA_CHARS:
        raise _refused(f"the schema of '{field}' is {len(grammar[1])} characters, over {MAX_SCHEMA_CHARS}", field)
    directory = model.codec.directory
    if directory is None or not (directory / "tokenizer.json").is_file():
        raise _refused(f"'{field}' needs the checkpoint's tokenizer.json, which this model has not", field)
    try:
        _grammars(directory / "tokenizer.json", model.vocab_size, model.eos_ids).check(*grammar)
    except GrammarError as exc:
        raise _refused(f"'{field}': the grammar library refuses the schema: {exc}", field) from None


@functools.cache
def _grammars(tokenizer: Path, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    from mbridge_epoverlap.serving.decoding.grammar import Grammars

    return Grammars(tokenizer, vocab_size, eos_ids)


def _logprobs(body: dict[str, Any], model: ModelInfo, chat: bool) -> tuple[int | None, bool]:
    """(k of the log-probabilities asked for or None, echo)."""
    limit = model.max_logprobs
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise _refused(f"'logprobs' must be a boolean, got {shown(wanted)}", "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if not is_int(top) or not 0 <= top <= limit:
                raise _refused(f"'top_logprobs' must be an integer from 0 to {limit} (--max-logprobs), got "
                             f"{shown(top)}", "top_logprobs")
            if not wanted:
                raise _refused("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return ((top or 0) if wanted else None), False
    k = body.get("logprobs")
    if k is not None and (not is_int(k) or not 0 <= k <= limit):
        raise _refused(f"'logprobs' must be an integer from 0 to {limit} (--max-logprobs), got {shown(k)}", "logprobs")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise _refused(f"'echo' must be a boolean, got {shown(echo)}", "echo")
    return k, bool(echo)


def _count(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or value < 1:
        raise _refused(f"'{name}' must be an integer of at least 1, got {shown(value)}", name)
    return value


def _ranged(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _refused(f"'{name}' must be a number from {low:g} to {high:g}, got {shown(value)}", name)
    return float(value)


def _repetition(body: dict[str, Any]) -> float:
    value = body.get("repetition_penalty")
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not MIN_REPETITION_PENALTY <= value <= MAX_REPETITION_PENALTY:
        raise _refused(f"'repetition_penalty' must be a number from {MIN_REPETITION_PENALTY:g} to "
                       f"{MAX_REPETITION_PENALTY:g} (1: none), got {shown(value)}", "repetition_penalty")
    return float(value)


def _logit_bias(body: dict[str, Any], model: ModelInfo) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` (keys are strings in JSON; integers taken too), in token order."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise _refused(f"'logit_bias' must be an object of token id to bias, got {shown(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise _refused(f"'logit_bias' key {shown(key)} is not a token id", "logit_bias") from None
        if not 0 <= token < model.vocab_size:
            raise _refused(f"'logit_bias' token {token} is outside the vocabulary 0..{model.vocab_size - 1}",
                         "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise _refused(f"'logit_bias' of token {token} must be a number from -100 to 100, got {shown(value)}",
                         "logit_bias")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _token_ids(body: dict[str, Any], name: str, model: ModelInfo) -> tuple[int, ...]:
    ids = body.get(name)
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise _refused(f"'{name}' must be a list of token ids, got {shown(ids)}", name)
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise _refused(f"'{name}' token ids {bad[:5]} are outside the vocabulary 0..{model.vocab_size - 1}", name)
    return tuple(dict.fromkeys(ids))


def _refused(message: str, field: str) -> ApiError:
    return ApiError(400, message, param=field)
