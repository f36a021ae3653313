"""`serve-bench` pieces: synthetic requests, balanced stage sizing, the reference check, the machine.

`finish_bench_result` is the one place an engine result becomes a bench result (the reference check, the
machine, the model), for `serve`, `serve-bench`, `elastic-bench`, the cluster job's `collect` and the
harness alike.

Balanced sizing: the ping-pong pipeline only pays off when an attention stage and an expert stage take
about as long, and when splitting a batch in two halves each stage's time (a stage that is mostly fixed
cost, such as 128 small expert GEMMs for a handful of tokens, takes as long for half the tokens). The
bench times one layer of attention-side work and one expert layer of the model in this process for
candidate micro-batch sizes b (doubling) and picks the b with the largest expected two-micro-batch gain
`(A(2b) + E(2b)) / (2 * max(A(b), E(b)))`: one micro-batch of 2b runs both stages one after the other,
two of b overlap them. That is the balanced size whose stage times also scale with the batch. Where no
doubled size was probed, the closest times (by ratio) decide. The numbers it measured are reported.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

from mbridge_epoverlap.machine import machine
from mbridge_epoverlap.serving.workers.requests import Request

BATCH_CANDIDATES = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
PROMPT_LEN = 8


def synthetic_requests(count: int, vocab_size: int, *, prompt_len: int = PROMPT_LEN, seed: int = 0) -> list[Request]:
    """`count` random prompts of `prompt_len` tokens (ids 1.. to stay clear of special tokens at 0)."""
    rng = random.Random(seed)
    return [Request(f"r{i}", tuple(rng.randrange(1, vocab_size) for _ in range(prompt_len))) for i in range(count)]


def matches_reference(spec: Any, requests: Sequence[Request], completions: Sequence[dict[str, Any]],
                      max_new_tokens: int) -> bool:
    """Whether every generated token equals the single-process greedy reference of the same weights."""
    from mbridge_epoverlap.serving.model.parts import generate_reference

    expected = generate_reference(spec, [list(r.prompt_ids) for r in requests], max_new_tokens)
    got = {c["id"]: c["output_ids"] for c in completions}
    return all(got.get(r.id) == list(e) for r, e in zip(requests, expected, strict=True))


def finish_bench_result(result: dict[str, Any], spec: Any, *, requests: Sequence[Request] | None = None,
                        max_new_tokens: int = 0, succeeded: bool = True) -> dict[str, Any]:
    """Add what a bench result carries beside the engine's own fields, in place, and return it.

    `matches_reference` (only when `requests` are given: whether every token equals the single-process
    reference, False for a run that did not succeed), then `machine`, `model`, `kv_cache_bytes_per_token` (over
    all layers: a latent attention model's latents, another's keys and values) and `state_bytes_per_sequence` (a
    hybrid model's DeltaNet or Mamba-2 states, whatever the length; 0 for others).
    """
    if requests is not None:
        result["matches_reference"] = succeeded and matches_reference(spec, requests, result["completions"],
                                                                      max_new_tokens)
    from mbridge_epoverlap.serving.model.kv_cache import kv_cache_bytes_per_token

    result["machine"] = machine()
    result["model"] = spec.describe()
    from mbridge_epoverlap.serving.model.linear.state_cache import state_bytes_per_sequence

    result["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(spec)
    result["state_bytes_per_sequence"] = state_bytes_per_sequence(spec)
    return result


def _timed(fn: Any, repeats: int = 5) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]


def stage_probe(spec: Any, micro_batch: int, *, attn_workers: int = 1, expert_workers: int = 1,
                context: int = PROMPT_LEN + 8, threads: int = 1) -> dict[str, float]:
    """Time one decode layer's attention-side work for `micro_batch` sequences (attention, router, and the
    gate-weighted sum after the experts) and the matching expert layer (ms), with `threads` torch threads
    (this process keeps them after the probe).

    The expert side gets the tokens of all attention workers, spread over the expert workers.
    """
    import torch

    from mbridge_epoverlap.serving.model.parts import KVCache, TokenBatch, load_attention_part, load_expert_part
    from mbridge_epoverlap.serving.workers.placement import Placement

    torch.set_num_threads(threads)
    layer = spec.moe_layer_ids[0]
    attention = load_attention_part(spec, packed=True)
    placement = Placement.balanced(spec.num_experts, expert_workers)
    experts = load_expert_part(spec, placement.experts_of(0), packed=True)
    with torch.no_grad():
        cache = KVCache.for_engine(spec)
        chunks = [(seq, [1] * context, 0) for seq in range(micro_batch)]
        for seq in range(micro_batch):
            cache.add(seq)
        prefill = TokenBatch.from_chunks(chunks)
        hidden = attention.embed(prefill.token_ids)
        attention.attention_step(layer, hidden, prefill, cache)
        x = hidden[:micro_batch]
        position = [context]

        def attend() -> None:
            # One decode token per sequence, at the next position each repeat (the cache grows by one).
            step = TokenBatch.from_chunks([(seq, [1], position[0]) for seq in range(micro_batch)])
            out = attention.attention_step(layer, x, step, cache)
            attention.post_step(layer, out, expert_out)
            position[0] += 1

        expert_out = torch.zeros(micro_batch, spec.top_k, spec.hidden_size, dtype=x.dtype)

        t_attn = _timed(attend)
        rows = max(1, micro_batch * attn_workers * spec.top_k // expert_workers)
        mine = torch.tensor(placement.experts_of(0))
        ids = mine[torch.randint(0, len(mine), (rows,), generator=torch.Generator().manual_seed(1))]
        tokens = hidden[:1].expand(rows, -1).contiguous()
        t_expert = _timed(lambda: experts(layer, tokens, ids))
    return {"micro_batch": micro_batch, "attn_ms": t_attn * 1e3, "experts_ms": t_expert * 1e3}


def describe_probe(probe: dict[str, float]) -> str:
    """One probe's stage times (and expected gain, where computed), as the bench and `serve-bench` print it."""
    gain = f", expected m=2 gain {probe['expected_gain']:.2f}x" if "expected_gain" in probe else ""
    return f"attention {probe['attn_ms']:.2f} ms, experts {probe['experts_ms']:.2f} ms{gain}"


def balanced_micro_batch(spec: Any, *, attn_workers: int, expert_workers: int,
                         candidates: Sequence[int] = BATCH_CANDIDATES) -> tuple[int, list[dict[str, float]]]:
    """The candidate micro-batch size with the largest expected ping-pong gain (module docstring); all probes,
    each with its `expected_gain` where the doubled size was probed too."""
    probes = [stage_probe(spec, b, attn_workers=attn_workers, expert_workers=expert_workers) for b in candidates]
    by_size = {int(p["micro_batch"]): p for p in probes}
    for p in probes:
        doubled = by_size.get(2 * int(p["micro_batch"]))
        if doubled is not None:
            p["expected_gain"] = (doubled["attn_ms"] + doubled["experts_ms"]) / (
                2 * max(p["attn_ms"], p["experts_ms"], 1e-9))
    gains = [p for p in probes if "expected_gain" in p]
    if gains:
        best = max(gains, key=lambda p: p["expected_gain"])
    else:
        best = min(probes, key=lambda p: abs(math.log(max(p["attn_ms"], 1e-9) / max(p["experts_ms"], 1e-9))))
    return int(best["micro_batch"]), probes
