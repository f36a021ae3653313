"""`DecodeOptions`: one sequence's decoding settings beyond temperature, top-p and top-k, as they travel from the
front end (which checks them, `frontend.openai_api`) to the attention worker that decodes the sequence.

They travel as a JSON object (`to_wire`, `from_wire`) inside the online `Submit`; a request without any of them
sends none, and its rows are decoded exactly as before (greedy rows bitwise unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class DecodeOptions:
    """What a sequence asks of its logits and of what is reported.

    Attributes:
        logprobs: report each generated token's log-probability and the `logprobs` most likely tokens' (0: the
            chosen token's only); None: none.
        prompt_logprobs: the same for every prompt token after the first (OpenAI's `echo` with `logprobs`).
        presence_penalty, frequency_penalty: subtracted from the logit of each token the sequence generated
            (once, and once per time it was generated), as OpenAI and vLLM define them.
        repetition_penalty: divides a positive logit and multiplies a negative one of every token in the prompt
            or generated (1: none), as `transformers` and vLLM define it.
        logit_bias: (token id, bias) pairs added to the logits.
        min_tokens: the end-of-sequence and stop tokens are masked until this many tokens were generated.
        stop_token_ids: tokens that end the sequence like an end-of-sequence token (even with `ignore_eos`).
        earlier_outputs: the last tokens of the prompt that are this request's own earlier output (a request
            moved to another worker goes on from its prompt and what it generated): penalties, minimum tokens
            and the grammar count them as generated.
        grammar: ("json_object", "") or ("json_schema", the schema's JSON text): each token is masked to those
            the grammar allows (`decoding.grammar`); None: free text.
    """

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    earlier_outputs: int = 0
    grammar: tuple[str, str] | None = None

    @property
    def penalizes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def changes_logits(self) -> bool:
        """Whether the sequence's logits are changed before its token is chosen (else they are the model's)."""
        return self.penalizes or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None

    def to_wire(self) -> dict[str, Any] | None:
        """The fields that differ from the defaults, as JSON values; None when every field is its default."""
        default = DecodeOptions()
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in out.items() if value != getattr(default, name)} or None

    @classmethod
    def from_wire(cls, wire: dict[str, Any] | None) -> DecodeOptions:
        """The options of a received JSON object (lists back to tuples).

        Raises:
            TypeError: a field this version does not know.
        """
        if not wire:
            return cls()
        values = dict(wire)
        if "logit_bias" in values:
            values["logit_bias"] = tuple((int(t), float(b)) for t, b in values["logit_bias"])
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"])
        if values.get("grammar") is not None:
            kind, schema = values["grammar"]
            values["grammar"] = (str(kind), str(schema))
        return cls(**values)

    def resumed(self, generated: int) -> DecodeOptions:
        """These options for the same request sent again with `generated` more tokens at its prompt's end (its
        prompt's log-probabilities went out with its first token, if it had one)."""
        if not generated:
            return self
        return replace(self, earlier_outputs=self.earlier_outputs + generated, prompt_logprobs=None)
