"""Requests, completions and the continuous-batching queue of one attention worker.

Requests join the running batch at step boundaries (up to a batch limit) and leave as soon as they
finish; each records when its tokens were produced, for time to first token and time between tokens.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError


@dataclass(frozen=True)
class Request:
    """One prompt to complete.

    Attributes:
        id, prompt_ids: the request's name and its prompt.
        max_new_tokens: its own generation limit (None: the queue's).
        ignore_eos: keep generating past an end-of-sequence token (only the limit stops it).
        sampling: temperature/top-p/top-k/seed sampling (`serving.decoding.sampling.SamplingParams`); None: greedy.
        options: log-probabilities, penalties, logit bias, minimum tokens, stop token ids, a grammar
            (`serving.decoding.options.DecodeOptions`); None: none of them.
    """

    id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int | None = None
    ignore_eos: bool = False
    sampling: Any = None
    options: Any = None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.options.stop_token_ids if self.options is not None else ()

    @property
    def scores_prompt(self) -> bool:
        """Whether it asks for its prompt tokens' log-probabilities (`echo`): every position's logits, so it is
        prefilled whole, never from a prefix cache."""
        return self.options is not None and self.options.prompt_logprobs is not None


def load_prompts(path: str | Path, *, vocab_size: int, tokenizer: Any = None) -> list[Request]:
    """Read a JSONL prompts file: one `{"id": ..., "prompt_ids": [int, ...]}` (or `"prompt": "text"`) a line.

    Raises:
        UsageError: the file is missing, a line is not JSON, a field is missing or out of range; the
            message names the file, the line and the field.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"--prompts {path}: {exc.strerror or exc}") from None
    requests: list[Request] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts {path} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise UsageError(f"{where}: expected an object with \"id\" and \"prompt_ids\"")
        rid = str(item.get("id", len(requests)))
        if rid in seen:
            raise UsageError(f"{where}: id {rid!r} appears twice; give every request its own id")
        seen.add(rid)
        if "prompt_ids" in item:
            ids = item["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                  for t in ids):
                raise UsageError(f"{where}: \"prompt_ids\" must be a non-empty list of integers")
        elif "prompt" in item:
            if tokenizer is None:
                raise UsageError(f"{where}: \"prompt\" text needs a checkpoint with a tokenizer; give "
                                 "\"prompt_ids\" instead")
            ids = list(tokenizer(str(item["prompt"])))
        else:
            raise UsageError(f"{where}: missing \"prompt_ids\" (or \"prompt\")")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise UsageError(f"{where}: token ids {bad[:5]} outside the vocabulary 0..{vocab_size - 1}")
        requests.append(Request(rid, tuple(ids)))
    if not requests:
        raise UsageError(f"--prompts {path}: no requests in the file")
    return requests


@dataclass
class RunningSequence:
    """A request being decoded: its tokens so far and when each output token appeared."""

    request: Request
    slot: int  # the id its KV cache is kept under
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    admitted_at: float = 0.0
    prefilled: bool = False  # its prompt is in the KV cache and it has sampled a token
    fed: int = 0  # tokens of its prefill text (prompt, then outputs) in the KV cache: a chunked prefill's progress
    chunk: int = 0  # tokens of its prefill text it feeds in the step being built (`RequestQueue.assign_chunks`)
    finished: bool = False
    aborted: bool = False  # the client went away: finished without a reason of its own
    generator: Any = None  # its random generator, made at its first sampled token (`sampling.sample`)
    error: str | None = None  # why its own sampling failed: it ends alone, failed (the batch goes on)
    grammar: Any = None  # its place in its grammar (`decoding.grammar.GrammarState`), made at its first token
    logprob: Any = None  # its last token's log-probability record (`decoding.logprobs`), when its request asks
    prompt_logprobs: list[Any] | None = None  # its prompt tokens' records so far, when its request asks (echo)

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def prefill_left(self) -> int:
        """Tokens of its prefill text (prompt, then any tokens it produced elsewhere) not yet in the KV cache."""
        return 0 if self.prefilled else self.length - self.fed

    @property
    def feeds(self) -> bool:
        """Whether it has tokens in the step being built: a decoding sequence always, a prefilling one when its
        chunk is not empty."""
        return self.prefilled or self.chunk > 0

    @property
    def samples(self) -> bool:
        """Whether the step being built gives it a token: its chunk ends its prefill text (or it decodes)."""
        return self.prefilled or (self.chunk > 0 and self.fed + self.chunk == self.length)

    def completion(self, status: str = "ok") -> dict[str, Any]:
        if self.error is not None:
            status = "failed"
        times = self.token_times
        ttft = (times[0] - self.admitted_at) * 1e3 if times else None
        tbt = [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
        return {"id": self.request.id, "output_ids": list(self.output_ids), "ttft_ms": ttft,
                "tbt_ms": tbt, "status": status}


def micro_batch_limit(max_batch: int, micro_batches: int, index: int) -> int:
    """How many of the `max_batch` running sequences micro-batch `index` of `micro_batches` may hold: an even
    share, the first `max_batch % micro_batches` micro-batches one more (micro-batch 0 holds the most)."""
    return max_batch // micro_batches + (1 if index < max_batch % micro_batches else 0)


class RequestQueue:
    """Continuous batching over one worker's requests.

    Args:
        requests: this worker's requests, in arrival order.
        max_batch: most sequences decoding at once; the others wait and join as sequences finish.
        max_new_tokens: stop a sequence after this many generated tokens.
        eos_ids: stop a sequence after it generated one of these.
    """

    def __init__(self, requests: Sequence[Request], *, max_batch: int, max_new_tokens: int,
                 eos_ids: Sequence[int]) -> None:
        if max_batch < 1:
            raise UsageError(f"max batch must be >= 1, got {max_batch}")
        self.waiting: deque[Request] = deque(requests)
        self.running: list[RunningSequence] = []
        self.done: list[RunningSequence] = []
        self.max_batch, self.max_new_tokens, self.eos_ids = max_batch, max_new_tokens, frozenset(eos_ids)
        self._next_slot = 0
        self.start = time.monotonic()
        # Online serving: the prompt tokens one admission's step may feed at most; a longer prompt is prefilled in
        # chunks over several steps (`assign_chunks`), so the sequences decoding beside it wait for at most this
        # many prompt tokens a step, and a micro-batch fits the M2N slot. None: whole prompts (offline: every
        # request is known up front).
        self.prefill_budget: int | None = None
        # (waiting request, running sequences) -> whether it waits for a later boundary although there is room
        # (`AttentionSide.waits_for_prefix`: a prompt whose first block another sequence is prefilling now starts
        # from that sequence's blocks once they are cached). None: nothing is held.
        self.hold: Any = None
        # Request -> the first tokens of its prompt a prefix cache fills (`PrefixCache.cached_tokens`): not counted
        # against the prefill budget, since only the rest is prefilled. None: every prompt counts whole.
        self.cached_tokens: Any = None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def step_boundary(self) -> tuple[list[RunningSequence], list[RunningSequence]]:
        """Retire finished sequences, admit waiting ones and give every prefilling sequence its chunk; return
        (admitted, retired)."""
        retired = self.retire(self.running)
        admitted = self.admit(self.max_batch - len(self.running), continuing=self.running)
        self.assign_chunks(self.running)
        return admitted, retired

    def retire(self, seqs: Sequence[RunningSequence]) -> list[RunningSequence]:
        """Move the finished ones of `seqs` (running sequences) to done; return them."""
        retired = [s for s in seqs if s.finished]
        if retired:
            gone = {id(s) for s in retired}
            self.running = [s for s in self.running if id(s) not in gone]
            self.done += retired
        return retired

    def admit(self, limit: int, *, continuing: Sequence[RunningSequence] = ()) -> list[RunningSequence]:
        """Start up to `limit` waiting requests (never past `max_batch` running); return them.

        With a `prefill_budget`, requests start while the step has prompt tokens left to feed: the prefills of
        `continuing` (the sequences of the same step whose prefill goes on) come first, and the last request
        admitted may get only part of its prompt this step (`assign_chunks`).
        """
        admitted: list[RunningSequence] = []
        held: list[Request] = []
        tokens = sum(s.prefill_left for s in continuing)
        while self.waiting and len(admitted) < limit and len(self.running) < self.max_batch:
            if self.prefill_budget is not None and tokens >= self.prefill_budget:
                break
            if self.hold is not None and self.hold(self.waiting[0], self.running):
                held.append(self.waiting.popleft())
                continue
            request = self.waiting.popleft()
            tokens += len(request.prompt_ids) - (self.cached_tokens(request) if self.cached_tokens else 0)
            seq = RunningSequence(request, self._next_slot, admitted_at=self.start)
            if request.scores_prompt:
                seq.prompt_logprobs = [None]  # the first prompt token has no context to score it
            self._next_slot += 1
            self.running.append(seq)
            admitted.append(seq)
        self.waiting.extendleft(reversed(held))  # first in the queue still, for the next boundary
        return admitted

    def assign_chunks(self, seqs: Sequence[RunningSequence]) -> None:
        """Give each prefilling sequence of `seqs` (one admission's step, oldest first) its chunk: the rest of
        its prefill text while the `prefill_budget` lasts, then what is left of the budget, then nothing (it
        waits for the next step). Without a budget every prefill is whole."""
        budget = self.prefill_budget
        for seq in seqs:
            if seq.prefilled:
                continue
            seq.chunk = seq.prefill_left if budget is None else min(seq.prefill_left, budget)
            if budget is not None:
                budget -= seq.chunk

    def append_token(self, seq: RunningSequence, token: int) -> None:
        seq.output_ids.append(token)
        seq.token_times.append(time.monotonic())
        seq.prefilled = True
        if self.stop_reason(seq) is not None:
            seq.finished = True

    def stop_reason(self, seq: RunningSequence) -> str | None:
        """Why `seq` stops after its last token: "stop" (an end-of-sequence token), "length" (its limit), or None."""
        request = seq.request
        if seq.output_ids and not request.ignore_eos and seq.output_ids[-1] in self.eos_ids:
            return "stop"
        if seq.output_ids and seq.output_ids[-1] in request.stop_token_ids:
            return "stop"
        limit = request.max_new_tokens if request.max_new_tokens is not None else self.max_new_tokens
        return "length" if len(seq.output_ids) >= limit else None

    def completions(self, *, failed: bool = False) -> list[dict[str, Any]]:
        """Every request's result; with `failed`, unfinished ones are reported as failed."""
        out = [s.completion() for s in self.done]
        out += [s.completion("ok" if s.finished else "failed") for s in self.running]
        out += [{"id": r.id, "output_ids": [], "ttft_ms": None, "tbt_ms": [], "status": "failed" if failed
                 else "not started"} for r in self.waiting]
        return out
