"""The attention side of a worker: its sequences, their KV cache, attention, router and gating, sampling.

`AttentionSide` runs the attention role's compute steps (`attn`, `post`) and holds what a decode step knows
(running micro-batches, whether this worker had work, whether the experts said stop, the step log); a
transport (`protocol.Transport`) does the steps in between. A decode micro-batch's state travels between the
steps in a `MicroBatchHandle`. Gate weights stay here: `post` sums the k expert outputs in a fixed order, so
the result is bitwise the single-process one whatever the placement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from mbridge_epoverlap.schedule.program import ATTN, DISPATCH, POST, Phase, Stage
from mbridge_epoverlap.serving.workers.protocol import Combine
from mbridge_epoverlap.serving.workers.requests import RequestQueue, RunningSequence, micro_batch_limit
from mbridge_epoverlap.serving.workers.stage_timer import StageTimer

R = TypeVar("R")
PROGRESS_EVERY = 16  # decode steps between progress lines
SAMPLE_STAGE = "sample"  # the stage timer's name for the head and token choice inside the last layer's post


@dataclass
class MicroBatchHandle:
    """A decode micro-batch's state as it travels through the layer program on an attention worker."""

    index: int
    seqs: list[RunningSequence] = field(default_factory=list)
    batch: Any = None  # TokenBatch
    x: torch.Tensor | None = None  # hidden states entering the next attention
    last_rows: list[int] = field(default_factory=list)  # row of each sampling sequence's last token
    sampling: list[RunningSequence] = field(default_factory=list)  # the sequences this step gives a token
    # (sequence, first row, rows, its position of the first row) of each prompt chunk whose log-probabilities
    # its request asks for (`echo`)
    prompt_rows: list[tuple[RunningSequence, int, int, int]] = field(default_factory=list)
    attn: Any = None  # AttnOut of the current layer
    routes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per expert worker: (token, slot)
    receives: list[Any] = field(default_factory=list)  # combine Works, one per expert worker
    sends: list[Any] = field(default_factory=list)
    expert_out: torch.Tensor | None = None
    issued_at: float = 0.0  # when the current layer's dispatch was issued
    cache: Any = None  # its own KVCache when sequences stay in this micro-batch (streamed steps)

    @property
    def empty(self) -> bool:
        """No token this step (no sequence, or only prefills that wait for a later chunk)."""
        return not any(seq.feeds for seq in self.seqs)


def split_micro_batches(seqs: Sequence[RunningSequence], micro_batches: int) -> list[MicroBatchHandle]:
    """Deal the running sequences into `micro_batches` handles, balanced by token count."""
    handles = [MicroBatchHandle(i) for i in range(micro_batches)]
    loads = [0] * micro_batches
    for seq in seqs:
        tokens = seq.chunk if not seq.prefilled else 1
        target = loads.index(min(loads))
        handles[target].seqs.append(seq)
        loads[target] += tokens
    return handles


class AttentionSide:
    """Owns a set of sequences, their KV cache, attention, router, gating and sampling.

    Args:
        spec: the model spec.
        part: this worker's `AttentionPart` (loaded weights).
        cache: its `KVCache`.
        queue: its requests (continuous batching).
        micro_batches: m, micro-batches in flight.
        timeout_s: limit of every wait.
        compute_stages: the stages its timer counts as busy (a colocated worker adds the experts).
    """

    stages: tuple[tuple[Stage, Phase], ...] = ((ATTN, Phase.RUN), (POST, Phase.RUN))

    def __init__(self, spec: Any, part: Any, cache: Any, queue: RequestQueue, micro_batches: int, timeout_s: float,
                 compute_stages: frozenset[str] = frozenset({ATTN.name, POST.name, DISPATCH.name})) -> None:
        from mbridge_epoverlap.serving.decoding.sampling import greedy
        from mbridge_epoverlap.serving.model.parts import TokenBatch

        self.spec, self.part, self.cache, self.queue = spec, part, cache, queue
        self.m, self.timeout_s = micro_batches, timeout_s
        self.first_moe = spec.moe_layer_ids[0]
        self.timer = StageTimer(compute_stages)
        self.TokenBatch = TokenBatch
        self.greedy = greedy
        self.decode_steps = 0
        self.stop = False  # the experts answered "stop": no attention worker had work left
        self.active = False  # this worker had work when micro-batch 0 started the step (every dispatch says)
        self.tokens_generated = 0
        self.step_log: list[tuple[float, int]] = []  # (seconds, tokens generated) of each decode step
        self._step_rows = 0  # token rows the running step fed so far: prompt chunks and decoding tokens
        # Called with (seconds, rows fed) after each step that fed tokens (the online server's step metrics).
        self.on_step: Callable[[float, int], None] | None = None
        self.handles: list[MicroBatchHandle] = []  # streamed steps: the m micro-batches, each with its cache
        self.on_sampled: list[Callable[[MicroBatchHandle], None]] = []  # after a micro-batch's new tokens
        # Online serving (`workers.online.OnlineSource`): polled at every step boundary for new requests and
        # aborts; while it serves, this worker counts as active, so the experts never answer stop.
        self.source: Any = None
        # A process with several cores: torch's or the tiled expert GEMMs' threads, as each step's size asks
        # (`workers.step_cores.StepCores`); None leaves the threads as they are.
        self.cores: Any = None
        # (token, choice) pairs routed to each expert, `[MoE layers, experts]`, since the start: the report's
        # and the online server's expert-load figures (what the router chose, counted where it chose it).
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layer_ids)}
        self.expert_load = torch.zeros(len(self.moe_index), spec.num_experts, dtype=torch.int64)
        self._grammars: Any = None  # `decoding.grammar.Grammars`, made at the first request that asks for one
        # Automatic prefix caching (`model.prefix_cache.PrefixCache`): prompts start from the blocks earlier
        # prompts left; None: every prompt is prefilled whole.
        self.prefix_cache: Any = None

    # --- step boundaries ----------------------------------------------------------------------------
    def boundary(self) -> None:
        """A drained step's boundary: retire finished sequences, admit waiting ones, for every micro-batch."""
        if self.source is not None:
            self.source.at_boundary(self, self.queue.running, first=True)
        admitted, retired = self.queue.step_boundary()
        for seq in retired:
            self.cache.free(seq.slot)
        for seq in admitted:
            self.start(seq, self.cache)
        if admitted and self.prefix_cache is not None:
            self.queue.assign_chunks(self.queue.running)  # what a prefix hit left to prefill
        self.active = bool(self.queue.running) or (self.source is not None and self.source.serving)

    def refill(self, h: MicroBatchHandle) -> None:
        """Micro-batch `h`'s step boundary (streamed steps): retire its finished sequences, admit its share of
        the waiting ones.

        The share is what is waiting spread over this and the later micro-batches of the round (so a first
        batch of requests is dealt evenly), capped by this micro-batch's part of the batch limit.
        """
        if self.source is not None:
            self.source.at_boundary(self, h.seqs, first=h.index == 0)
        for seq in self.queue.retire(h.seqs):
            h.cache.free(seq.slot)
        h.seqs = [seq for seq in h.seqs if not seq.finished]
        limit = micro_batch_limit(self.queue.max_batch, self.m, h.index)
        share = -(-len(self.queue.waiting) // (self.m - h.index))
        for seq in self.queue.admit(min(share, limit - len(h.seqs)), continuing=h.seqs):
            self.start(seq, h.cache)
            h.seqs.append(seq)
        self.queue.assign_chunks(h.seqs)
        if h.index == 0:  # the control every dispatch of this step carries (read by the experts at micro-batch 0)
            self.active = bool(self.queue.waiting) or any(not s.finished for g in self.handles for s in g.seqs)
            self.active = self.active or (self.source is not None and self.source.serving)

    def start(self, seq: RunningSequence, cache: Any) -> None:
        """A newly admitted sequence's place in `cache`: empty, or the cached blocks its prompt begins with."""
        cache.add(seq.slot)
        if self._reuses_prefixes(seq.request):
            blocks = self.prefix_cache.match(seq.request.prompt_ids)
            if blocks:
                seq.fed = cache.load(seq.slot, blocks)

    def cached_prefix_tokens(self, request: Any) -> int:
        """The first tokens of `request`'s prompt its start would take from the prefix cache (`start`)."""
        return self.prefix_cache.cached_tokens(request.prompt_ids) if self._reuses_prefixes(request) else 0

    def waits_for_prefix(self, request: Any, running: Sequence[RunningSequence]) -> bool:
        """Whether a waiting request should start at a later boundary: a running sequence is prefilling a prompt
        that begins with the same full block, and the prefix cache has not got that block yet. Started now, both
        would prefill the shared prefix; one step later the request starts from its cached blocks (the `n`
        choices of one prompt prefill it once; a burst of prompts sharing a system prompt, once per worker)."""
        if not self._reuses_prefixes(request):
            return False
        size = self.prefix_cache.block_tokens
        first = tuple(request.prompt_ids[:size])
        if len(request.prompt_ids) <= size or self.prefix_cache.has_first(first):
            return False
        return any(not seq.prefilled and len(seq.request.prompt_ids) > size
                   and tuple(seq.request.prompt_ids[:size]) == first for seq in running)

    def _reuses_prefixes(self, request: Any) -> bool:
        """Whether `request` starts from cached blocks: there is a prefix cache and it does not score its prompt."""
        return self.prefix_cache is not None and not request.scores_prompt

    def finish(self) -> None:
        """After the last step: retire what finished (drained steps)."""
        for seq in self.queue.running:
            if seq.finished:
                self.cache.free(seq.slot)
        self.queue.step_boundary()

    def tokens_running(self) -> int:
        return sum(len(s.output_ids) for s in self.queue.running)

    def log_step(self, started: float, tokens_before: int) -> None:
        self.record_step(time.perf_counter() - started, self.tokens_running() - tokens_before)

    def record_step(self, seconds: float, tokens: int) -> None:
        """A decode step ended: its time and tokens go into the step log, its untimed time into the timer's
        `overhead` stage (not for a step without tokens: an idle server's step is its wait for requests)."""
        self.step_log.append((seconds, tokens))
        self.timer.step_done(record=tokens > 0)
        rows, self._step_rows = self._step_rows, 0
        if self.on_step is not None and rows > 0:
            self.on_step(seconds, rows)

    def progress_line(self) -> str | None:
        """Every `PROGRESS_EVERY` decode steps, the line that says how far decoding is (else None); done counts
        the finished sequences, retired or not yet."""
        if self.decode_steps % PROGRESS_EVERY:
            return None
        done = len(self.queue.done) + sum(s.finished for s in self.queue.running)
        return (f"decode step {self.decode_steps}: {len(self.queue.running)} running, "
                f"{len(self.queue.waiting)} waiting, {done} done")

    # --- the attention role's compute steps ---------------------------------------------------------
    def _attn(self, h: MicroBatchHandle, layer: int) -> None:
        if h.empty:
            return
        with self.timer.time(ATTN.name):
            if layer == 0:
                self._build_batch(h)
                if self.cores is not None:
                    self.cores.for_step(len(h.batch))
            h.attn = self.part.attention_step(layer, h.x, h.batch, h.cache or self.cache)

    def _build_batch(self, h: MicroBatchHandle) -> None:
        """The micro-batch's tokens: a prefilling sequence's chunk of its prompt (the whole prompt unless a
        prefill budget splits it), else its last token; the rows sampled are the last of each sequence whose
        prefill ends here and of each decoding one."""
        chunks, h.sampling, h.last_rows, h.prompt_rows = [], [], [], []
        rows = 0
        for seq in h.seqs:
            if seq.prefilled:  # one new token, at the end of what the cache holds
                chunks.append((seq.slot, seq.output_ids[-1:], seq.length - 1))
            elif seq.chunk:
                text = list(seq.request.prompt_ids) + seq.output_ids
                chunks.append((seq.slot, text[seq.fed:seq.fed + seq.chunk], seq.fed))
                if seq.prompt_logprobs is not None:
                    h.prompt_rows.append((seq, rows, seq.chunk, seq.fed))
            else:
                continue  # its prefill waits for a later step's budget
            rows += len(chunks[-1][1])
            if seq.samples:
                h.sampling.append(seq)
                h.last_rows.append(rows - 1)
        h.batch = self.TokenBatch.from_chunks(chunks)
        h.x = self.part.embed(h.batch.token_ids)
        self._step_rows += rows

    def _post(self, h: MicroBatchHandle, layer: int) -> None:
        if h.empty:
            return
        with self.timer.time(POST.name):
            expert_out = h.expert_out if self.spec.is_moe(layer) else None
            if expert_out is not None:
                self.expert_load[self.moe_index[layer]] += torch.bincount(h.attn.expert_ids.flatten(),
                                                                          minlength=self.spec.num_experts)
            h.x = self.part.post_step(layer, h.attn, expert_out)
            h.attn, h.expert_out = None, None
            if layer == self.spec.num_layers - 1:
                for seq in h.seqs:
                    if not seq.prefilled and seq.chunk:  # this chunk of its prefill is in the cache now
                        seq.fed += seq.chunk
                        seq.chunk = 0
                        if self.prefix_cache is not None and seq.fed == seq.length:  # its whole prompt
                            self.prefix_cache.insert(seq.request.prompt_ids, h.cache or self.cache, seq.slot)
                with self.timer.time(SAMPLE_STAGE):  # the head and the choice of tokens: once per step
                    tokens = self._next_tokens(h) if h.sampling else []
                for seq, token in zip(h.sampling, tokens, strict=True):
                    self.queue.append_token(seq, int(token))
                    if seq.error is not None:
                        seq.finished = True
                self.tokens_generated += len(h.sampling)
                for listener in self.on_sampled:
                    listener(h)

    def _next_tokens(self, h: MicroBatchHandle) -> list[int]:
        """Each sequence's next token: greedy, or sampled with the sequence's own generator when its request
        asks for sampling; its logits first changed by its request's options (penalties, logit bias, minimum
        tokens, grammar), and the log-probabilities it asks for recorded. A row whose request asks for none of
        these stays bitwise what it was. A sequence whose sampling fails gets its `error` set and the greedy
        token, and ends alone: its settings are its own, the batch's are not."""
        logits = self.part.logits(h.x[h.last_rows])
        tokens = self.greedy(logits)
        if h.prompt_rows:
            self._prompt_logprobs(h)
        for row, seq in enumerate(h.sampling):
            params, options = seq.request.sampling, seq.request.options
            if params is None and (options is None or not options.changes_logits):
                continue
            try:
                chosen = logits[row]
                if options is not None and options.changes_logits:
                    chosen = self._changed(seq, chosen)
                    if params is None:
                        tokens[row] = int(torch.argmax(chosen))
                if params is not None:
                    from mbridge_epoverlap.serving.decoding.sampling import sample

                    if seq.generator is None:
                        seq.generator = params.generator()
                    tokens[row] = sample(chosen, params, seq.generator)
                if seq.grammar is not None:
                    seq.grammar.accept(tokens[row])
            except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
                seq.error = f"its sampling failed ({type(exc).__name__}: {exc})"
        asking = [row for row, seq in enumerate(h.sampling)
                  if seq.request.options is not None and seq.request.options.logprobs is not None]
        if asking:
            from mbridge_epoverlap.serving.decoding.logprobs import records

            found = records(logits[asking], [tokens[r] for r in asking],
                            [h.sampling[r].request.options.logprobs for r in asking])
            for row, record in zip(asking, found, strict=True):
                h.sampling[row].logprob = record
        return tokens

    def _changed(self, seq: RunningSequence, row: torch.Tensor) -> torch.Tensor:
        """A sequence's logits as its options change them (a new tensor: the model's row stays for its
        log-probabilities).

        Raises:
            ValueError: no token is left to choose (its grammar and minimum tokens forbid every one).
        """
        from mbridge_epoverlap.serving.decoding.processors import adjust

        request = seq.request
        options = request.options
        stop_ids = () if request.ignore_eos else tuple(self.queue.eos_ids)
        changed = adjust(row, options, request.prompt_ids, seq.output_ids, stop_ids)
        if options.grammar is not None:
            if seq.grammar is None:
                earlier = request.prompt_ids[len(request.prompt_ids) - options.earlier_outputs:]
                seq.grammar = self.grammars().state(*options.grammar, earlier=[*earlier, *seq.output_ids])
            seq.grammar.mask(changed)
        if not bool(torch.isfinite(changed).any()):
            raise ValueError("no token is allowed (its grammar, stop tokens and min_tokens forbid every one)")
        if bool(torch.isnan(changed).any()) or bool(torch.isposinf(changed).any()):
            raise ValueError("its penalties or logit bias made a logit NaN or infinite")
        return changed

    def grammars(self) -> Any:
        """This model's grammars (`decoding.grammar.Grammars`), made once, from its checkpoint's tokenizer.

        Raises:
            ValueError: the model has no `tokenizer.json` (the front end refuses such requests first).
        """
        if self._grammars is None:
            from pathlib import Path

            from mbridge_epoverlap.serving.decoding.grammar import Grammars

            tokenizer = Path(self.spec.source) / "tokenizer.json"
            if not tokenizer.is_file():
                raise ValueError(f"structured output needs the checkpoint's tokenizer, and {tokenizer} is missing")
            self._grammars = Grammars(tokenizer, self.spec.vocab_size, tuple(self.queue.eos_ids))
        return self._grammars

    def _prompt_logprobs(self, h: MicroBatchHandle) -> None:
        """The log-probability records of the prompt tokens this step's chunks predict (`echo`): the row at
        position p scores prompt token p + 1; the chunk's last row, where the prompt ends, scores the first
        generated token instead (its own record)."""
        from mbridge_epoverlap.serving.decoding.logprobs import prompt_records

        for seq, first, count, position in h.prompt_rows:
            prompt = seq.request.prompt_ids
            targets = list(prompt[position + 1:position + 1 + count])
            if targets and seq.prompt_logprobs is not None:
                rows = self.part.logits(h.x[first:first + len(targets)])
                seq.prompt_logprobs += prompt_records(rows, targets, seq.request.options.prompt_logprobs)

    # --- what every transport shares ----------------------------------------------------------------
    def dispatch_rows(self, h: MicroBatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [T, hidden], expert ids [T, k]) of a micro-batch to dispatch; an empty micro-batch still takes
        part in the exchange, with zero rows."""
        if h.empty:
            return (torch.zeros(0, self.spec.hidden_size, dtype=self.spec.torch_dtype()),
                    torch.zeros(0, self.spec.top_k, dtype=torch.int64))
        return h.attn.tokens, h.attn.expert_ids

    def wait_combine(self, h: MicroBatchHandle, wait: Callable[[], R]) -> R:
        """Run `wait` (the combine wait of `h`) timed as `combine_wait`, and record the round trip since the
        dispatch was issued (`h.issued_at`); the handle's receives are spent after it."""
        with self.timer.time("combine_wait", record=not h.empty):
            result = wait()
        if not h.empty:
            self.timer.record("round_trip", time.perf_counter() - h.issued_at)
        h.receives = []
        return result

    def note_combine(self, h: MicroBatchHandle, layer: int, reply: Combine | None) -> None:
        """The experts answer micro-batch 0's first MoE combine of a step with stop when no worker had work."""
        if layer == self.first_moe and h.index == 0 and reply is not None and reply.stop:
            self.stop = True
