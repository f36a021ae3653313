"""One request's engine sequences followed to the choices of its answer.

A request of P prompts with `best_of` b sequences each is P x b engine requests: sequence j of prompt i has the
request's seed + j (so choice j equals the same request sent alone with that seed, `n` 1) and is choice i x b + j.
`ChoiceState` turns one sequence's tokens into its choice: the text (stop strings, held-back characters), the
prompt's text first with `echo`, the log-probability records as they arrive (the prompt's with its first token),
and, for a tool call, its arguments. With `best_of` above `n` the `n` sequences of highest cumulative
log-probability of each prompt are kept (`best`), renumbered i x n + rank, as OpenAI's `best_of` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mbridge_epoverlap.serving.api import logprobs as logprob_format
from mbridge_epoverlap.serving.api import tools
from mbridge_epoverlap.serving.frontend.text import TextStream

_SEEDS = 1 << 64


def sequence_seed(seed: int | None, j: int) -> int | None:
    """Sequence j's seed: the request's + j, kept in the generator's 64-bit range (-2**63 .. 2**64 - 1)."""
    if seed is None:
        return None
    value = seed + j
    return value - _SEEDS if value >= _SEEDS else value


@dataclass
class ChoiceState:
    """One sequence's choice as its tokens arrive (`add`); `text`, `entries` and the rest are what it is so far.

    Args:
        index: its choice index before `best`.
        codec: the model's text codec.
        request: the parsed request (`frontend.openai_api.ParsedRequest`).
        prompt_ids: its prompt.
    """

    index: int
    codec: Any
    request: Any
    prompt_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    entries: list[tuple[int, Any]] = field(default_factory=list)  # (token, record) reported, prompt's first
    generated_entries: list[tuple[int, Any]] = field(default_factory=list)  # (token, record) of its own tokens
    tool_calls: list[dict[str, Any]] | None = None
    _offset: int = 0  # characters of text the reported entries cover (their `text_offset`)

    def __post_init__(self) -> None:
        self.stream = TextStream(self.codec, self.request.generation.stop)

    @property
    def choices(self) -> Any:
        return self.request.choices

    def add(self, token: int, finish: str | None, extra: dict[str, Any] | None) -> tuple[str, list[Any], bool]:
        """Take one token: (the text to send now, the (token, record) entries it reports, whether the sequence is
        finished: a stop string or the engine ended it). The caller aborts the engine request on a stop string."""
        extra = extra or {}
        new_entries: list[tuple[int, Any]] = []
        prefix = ""
        if not self.token_ids and not self.completion_tokens and self.choices.echo:
            prefix = self.codec.decode(self.prompt_ids)
            if self.choices.logprobs is not None:
                records = extra.get("prompt_logprobs") or [None] * len(self.prompt_ids)
                new_entries += list(zip(self.prompt_ids, records, strict=False))
        if self.choices.prompt_only:  # the one generated token is dropped: the prompt's records alone
            self.finish_reason = "length"
            return self._took(prefix, new_entries, True)
        self.token_ids.append(token)
        self.completion_tokens += 1
        record = extra.get("logprob")
        self.generated_entries.append((token, record))
        delta = self.stream.add(token)
        if self.stream.stopped:
            finish = "stop"
        elif finish is not None:
            delta += self.stream.finish()
        if self.choices.logprobs is not None:
            new_entries.append((token, record))
        if finish is not None:
            self.finish_reason = finish
            self._tool_calls()
        return self._took(prefix + delta, new_entries, finish is not None)

    def _took(self, delta: str, new_entries: list[Any], done: bool) -> tuple[str, list[Any], bool]:
        self.text += delta
        self.entries += new_entries
        return delta, new_entries, done

    def _tool_calls(self) -> None:
        choice = self.request.tool_choice
        if choice is None:
            return
        calls = tools.calls(choice, self.stream.text)
        if calls is not None:
            self.tool_calls = calls
            self.finish_reason = tools.finish_reason(choice)

    def logprobs_of(self, entries: Sequence[Any]) -> dict[str, Any] | None:
        """OpenAI's logprobs object of `entries` (a stream chunk's or the whole choice's), None if not asked."""
        if self.choices.logprobs is None:
            return None
        if self.request.chat:
            return logprob_format.chat(self.codec, entries)
        found = logprob_format.completion(self.codec, entries, self._offset)
        if found["tokens"]:  # the next chunk's text starts after this one's last token
            self._offset = found["text_offset"][-1] + len(found["tokens"][-1])
        return found

    def answer(self, index: int) -> dict[str, Any]:
        """The choice as `openai_api.response` takes it, numbered `index`."""
        self._offset = 0
        return {"index": index, "text": self.text, "finish_reason": self.finish_reason, "token_ids": self.token_ids,
                "completion_tokens": self.completion_tokens, "logprobs": self.logprobs_of(self.entries),
                "tool_calls": self.tool_calls}


def best(states: Sequence[ChoiceState], best_of: int, n: int) -> list[ChoiceState]:
    """Each prompt's `n` sequences of highest cumulative log-probability (ties: the earlier sequence), prompt by
    prompt; every sequence when `best_of` is `n`."""
    if best_of == n:
        return list(states)
    kept = []
    for first in range(0, len(states), best_of):
        group = states[first:first + best_of]
        ranked = sorted(group, key=lambda s: -logprob_format.cumulative(s.generated_entries))
        kept += ranked[:n]
    return kept
