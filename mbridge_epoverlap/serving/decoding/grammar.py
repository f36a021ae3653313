"""Structured output with llguidance: a JSON schema (or any JSON object) as a mask of the tokens each step allows.

`Grammars` holds one model's tokenizer as llguidance reads it (from the checkpoint's `tokenizer.json`, the
vocabulary as wide as the model's logits, its end-of-sequence tokens) and makes a `GrammarState` per sequence.
The front end checks a request's schema with its own `Grammars` (a schema llguidance refuses answers 400 before
anything reaches a worker); the attention worker makes the state of each sequence that asks for one and masks
its rows (`mask`) before its token is chosen, then advances it with the token (`accept`).

JSON is generated without free whitespace (llguidance's `whitespace_flexible` off, as vLLM's default `any
whitespace` is off for its other backends): a model that likes whitespace cannot then emit it forever.
Once the grammar is complete the mask allows only the end-of-sequence tokens, so the sequence ends with "stop".
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

JSON_OBJECT, JSON_SCHEMA = "json_object", "json_schema"
KINDS = (JSON_OBJECT, JSON_SCHEMA)
_ANY_OBJECT = {"type": "object"}
_DEFAULTS = {"whitespace_flexible": False}
GRAMMARS_KEPT = 256  # distinct schemas whose grammar stays made


class GrammarError(ValueError):
    """A grammar llguidance refuses (the message says why)."""


class Grammars:
    """One model's grammars.

    Args:
        tokenizer_file: the checkpoint's `tokenizer.json`.
        vocab_size: the width of the model's logits (at least the tokenizer's).
        eos_ids: the model's end-of-sequence tokens.
    """

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        import llguidance
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        eos: Any = list(eos_ids) if eos_ids else None
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        # A schema is checked as its request arrives and made again for each of its sequences (`n` of them, and
        # on a worker after the front end): made once, the refusals (raised) made again.
        self.source = functools.lru_cache(maxsize=GRAMMARS_KEPT)(self._source)

    def _source(self, kind: str, schema: str) -> str:
        """llguidance's grammar of a request's `(kind, schema JSON text)` (`source`, cached).

        Raises:
            GrammarError: the schema is not JSON, or llguidance refuses it.
        """
        import llguidance

        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r} (known: {', '.join(KINDS)})")
        try:
            parsed = _ANY_OBJECT if kind == JSON_OBJECT else json.loads(schema)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(parsed), defaults=_DEFAULTS)
        except (ValueError, TypeError) as exc:  # JSONDecodeError, and llguidance's refusals of the schema
            raise GrammarError(str(exc)) from None
        except BaseException as exc:  # a panic inside llguidance (pyo3's PanicException is a BaseException)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            raise GrammarError(f"the grammar library failed on it ({type(exc).__name__}: {exc})") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(error)
        return grammar

    def check(self, kind: str, schema: str) -> None:
        """Raise GrammarError if the grammar of `(kind, schema)` cannot be made."""
        self.source(kind, schema)

    def state(self, kind: str, schema: str, earlier: list[int] | tuple[int, ...] = ()) -> GrammarState:
        """A new sequence's state, advanced past `earlier` (its own output from before it moved here)."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, self.source(kind, schema))
        state = GrammarState(matcher, self.vocab_size)
        for token in earlier:
            state.accept(token)
        return state


class GrammarState:
    """One sequence's place in its grammar.

    llguidance fills a bitmask of the allowed tokens (32 a word); the bits are unpacked here with plain torch ops.
    llguidance's own `apply_token_bitmask_inplace` runs a `torch.compile`d kernel, which needs a C compiler and
    seconds at first use, and under ATEN_CPU_CAPABILITY=avx2 left 192 of 384 tokens allowed where the grammar
    allowed 1 (torch 2.13, measured here).
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.torch as llg_torch

        self._matcher, self._llg_torch = matcher, llg_torch
        self.bitmask = llg_torch.allocate_token_bitmask(1, vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """`row` ([vocab] fp32 logits, changed in place and returned) with every token the grammar forbids at -inf.

        Raises:
            GrammarError: the grammar is in error (no token is allowed).
        """
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._llg_torch.fill_next_token_bitmask(self._matcher, self.bitmask, 0)
        return row.masked_fill_(~self.allowed(row.numel()), float("-inf"))

    def allowed(self, vocab: int) -> torch.Tensor:
        """The tokens the last filled bitmask allows, [vocab] bool (bit t % 32 of word t // 32)."""
        bits = (self.bitmask[0].unsqueeze(1) >> self._shifts) & 1  # an arithmetic shift: bit 31 reads right too
        return bits.reshape(-1)[:vocab].bool()

    def accept(self, token: int) -> None:
        """Advance past `token`; a token the mask forbade (the grammar refuses it) raises GrammarError."""
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} does not continue the grammar ({self._matcher.get_error()})")
