"""Where one step's time goes: a prefill and a decode step of the model in one process, split by part.

`step_breakdown` prefills a batch of prompts, then decodes, with timers around the model's pieces:
attention (norms, projections, rotary, KV cache, attention itself), router, dispatch (grouping the
(token, slot) rows by expert and scattering the results back), experts (the expert GEMMs), shared_expert
(an always-on shared expert, where the model has one: it runs on the attention side, in `post_step`), combine
(the gate-weighted sum and the residual), sampling (final norm, head, argmax) and the rest of the step
(Python and scheduling overhead: building the batch, the loop, bookkeeping). Idle time does not exist in
one process; an engine run's stage timers give it (`utilization` in the run result).

The timers wrap methods of one `LocalModel` instance and its parts (nothing global changes), so the step
is the engine's own arithmetic. Used by `benchmarks/serving_peers_bench.py --breakdown`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

PARTS = ("attention", "router", "dispatch", "experts", "shared_expert", "combine", "sampling", "overhead")


class _Clock:
    """Seconds spent in each named part; nested parts are subtracted from the part around them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []  # [name, started, seconds of nested parts]

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = time.perf_counter() - frame[1]
            self.seconds[name] += spent - frame[2]
            if self._stack:
                self._stack[-1][2] += spent

    def wrap(self, owner: Any, method: str, name: str) -> None:
        """Time `owner.method` as `name` (an instance attribute shadows the class's method)."""
        inner: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.part(name):
                return inner(*args, **kwargs)

        setattr(owner, method, timed)


def _instrument(model: Any, clock: _Clock) -> list[tuple[Any, str, Any]]:
    """Timers on `model`'s parts; returns the module functions patched (to restore)."""
    from mbridge_epoverlap.serving.model import parts

    attention = model.attention
    clock.wrap(attention, "embed", "attention")
    clock.wrap(attention, "attention_step", "attention")
    clock.wrap(attention, "post_step", "combine")
    clock.wrap(attention, "logits", "sampling")
    for block in attention.layers:
        if block.shared_expert is not None:  # nn.Module calls `self.forward`: an instance attribute shadows it
            clock.wrap(block.shared_expert, "forward", "shared_expert")
        if block.router is not None:  # each router kind's routing methods (grouped routers have `route`)
            for name in ("route",) if hasattr(block.router, "route") else ("softmax_topk", "topk_softmax"):
                clock.wrap(block.router, name, "router")
    # Module functions `LocalModel` and `ExpertPart` look up at call time: the (token, slot) rows' trip to
    # the experts and back (dispatch), and the expert GEMMs inside it.
    patched = [(parts, name, getattr(parts, name))
               for name in ("run_experts", "grouped_expert_swiglu", "packed_expert_swiglu", "greedy")]
    clock.wrap(parts, "run_experts", "dispatch")
    clock.wrap(parts, "grouped_expert_swiglu", "experts")
    clock.wrap(parts, "packed_expert_swiglu", "experts")
    clock.wrap(parts, "greedy", "sampling")
    return patched


def step_breakdown(spec: Any, prompts: Sequence[Sequence[int]], *, decode_steps: int = 8,
                   threads: int | None = None) -> dict[str, Any]:
    """Prefill `prompts` in one batch, then `decode_steps` decode steps of every sequence, timed by part.

    Returns:
        {"threads", "prefill": {"total_ms", "ms": {part: ms}}, "decode": {"total_ms" (median step),
        "ms": {part: median ms}}, "tokens_per_decode_step"}; "overhead" is the step minus the timed parts.
    """
    import torch

    from mbridge_epoverlap.serving.model.batch import TokenBatch
    from mbridge_epoverlap.serving.model.kv_cache import KVCache
    from mbridge_epoverlap.serving.model.parts import LocalModel, load_attention_part, load_expert_part

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        model = LocalModel(load_attention_part(spec, packed=True),
                           [load_expert_part(spec, range(spec.num_experts), packed=True)])
        cache = KVCache.for_engine(spec)
        clock = _Clock()
        patched = _instrument(model, clock)
        try:
            steps = []
            for seq in range(len(prompts)):
                cache.add(seq)
            chunks = [(seq, list(p), 0) for seq, p in enumerate(prompts)]
            lengths = [len(p) for p in prompts]
            with torch.no_grad():
                for _ in range(decode_steps + 1):
                    clock.seconds.clear()
                    started = time.perf_counter()
                    batch = TokenBatch.from_chunks(chunks)
                    nxt = model.next_tokens(batch, cache)
                    chunks = [(seq, [tok], lengths[seq]) for seq, tok in nxt.items()]
                    for seq in nxt:
                        lengths[seq] += 1
                    total = time.perf_counter() - started
                    ms = {name: 1e3 * clock.seconds.get(name, 0.0) for name in PARTS if name != "overhead"}
                    ms["overhead"] = 1e3 * total - sum(ms.values())
                    steps.append((1e3 * total, ms))
        finally:
            for module, name, inner in patched:
                setattr(module, name, inner)
    finally:
        torch.set_num_threads(before)
    decode = steps[1:]
    return {
        "threads": torch.get_num_threads() if threads is None else threads,
        "prefill": {"total_ms": steps[0][0], "ms": steps[0][1], "tokens": sum(len(p) for p in prompts)},
        "decode": {"total_ms": statistics.median(t for t, _ in decode),
                   "ms": {name: statistics.median(ms[name] for _, ms in decode) for name in PARTS}},
        "tokens_per_decode_step": len(prompts),
    }
