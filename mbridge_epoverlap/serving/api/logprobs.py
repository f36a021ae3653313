"""Log-probability records (`serving.decoding.logprobs`) as OpenAI's API returns them.

- `/v1/completions` (`completion`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per
  token; a prompt's first token (with `echo`) has none (`null`), as in OpenAI's and vLLM's answers. Each
  `top_logprobs` entry maps token text to log-probability: the k most likely and the chosen token, as vLLM's
  (two tokens of the same text: the likelier one's).
- `/v1/chat/completions` (`chat`): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.

A token's text is its own decoding with special tokens kept (an end-of-sequence token reads as itself);
`text_offset` counts characters from the start of the choice's text, token after token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mbridge_epoverlap.serving.frontend.text import TextCodec

Entry = tuple[int, Any]  # (token id, its record or None)


def completion(codec: TextCodec, entries: Sequence[Entry], offset: int = 0) -> dict[str, Any]:
    """The `logprobs` of a completion choice (or of a stream chunk whose text starts at `offset`)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token, record in entries:
        text = codec.token_text(token)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if record is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        chosen, best = record
        token_logprobs.append(chosen)
        top = {text: chosen}
        for t, lp in best:  # two tokens of the same text: the likelier one's (the key is text)
            key = codec.token_text(t)
            top[key] = max(lp, top.get(key, -math.inf))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat(codec: TextCodec, entries: Sequence[Entry]) -> dict[str, Any]:
    """The `logprobs` of a chat choice (or of a stream chunk)."""
    content = []
    for token, record in entries:
        if record is None:
            continue
        chosen, best = record
        content.append({**_token(codec, token, chosen),
                        "top_logprobs": [_token(codec, t, lp) for t, lp in best]})
    return {"content": content}


def cumulative(entries: Sequence[Entry]) -> float:
    """The sum of the chosen tokens' log-probabilities (how `best_of` ranks its sequences)."""
    return sum(record[0] for _, record in entries if record is not None)


def _token(codec: TextCodec, token: int, logprob: float) -> dict[str, Any]:
    text = codec.token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
