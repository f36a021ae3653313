"""Serving speed settings: torch threads per worker process are part of the layout."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.engine.plan import EnginePlan, default_threads
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.workers.requests import Request


def test_default_threads_share_the_cores_evenly_and_give_each_process_one_at_least():
    assert default_threads(1, cores=2) == 2
    assert default_threads(2, cores=2) == 1
    assert default_threads(3, cores=2) == 1
    assert default_threads(2, cores=16) == 8


def test_plan_threads_default_from_the_process_count_and_a_flag_forces_them(tiny_mixtral_dir, prompts):
    spec = load_spec(tiny_mixtral_dir)
    requests = [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]
    assert make_plan(spec, requests, colocated=1).threads == default_threads(1)
    assert make_plan(spec, requests, attn_workers=1, expert_workers=1).threads == default_threads(2)
    assert make_plan(spec, requests, colocated=1, threads=3).threads == 3
    with pytest.raises(UsageError, match="--threads -1"):
        make_plan(spec, requests, threads=-1)
    # A plan written before the field existed runs with one thread per process, as then.
    old = EnginePlan.from_json(make_plan(spec, requests, threads=1).to_json().replace('"threads": 1', '"threads": 0'))
    assert old.threads_per_process == 1


def test_workers_run_with_the_plans_threads_and_the_tokens_stay_the_same(tiny_mixtral_dir, prompts, hf_greedy):
    spec = load_spec(tiny_mixtral_dir)
    requests = [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]
    result = run_engine(make_plan(spec, requests, colocated=1, threads=2, max_new_tokens=4, timeout_s=20))
    assert result["worker_threads"] == [2] and result["threads_per_process"] == 2
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, 4)


def test_layout_choice_takes_the_faster_prediction_and_says_why(tiny_mixtral_dir, prompts, monkeypatch):
    from mbridge_epoverlap.serving.engine import bench
    from mbridge_epoverlap.serving.engine.choice.layout import choose_layout

    spec = load_spec(tiny_mixtral_dir)
    requests = [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]

    def probe(times, expert_share_at_half=0.5, half_the_experts=1.0):
        """(threads -> (attention ms, experts ms) at the whole batch) instead of a measurement: attention
        halves with half the batch, the experts by `expert_share_at_half` (1.0: bound by their weights); half
        the experts for the whole batch (one of two colocated EP ranks) take `half_the_experts` of all of them
        (1.0: two processes share one memory bus that bounds the experts)."""
        def fake(spec, micro_batch, *, context, threads, attn_workers=1, expert_workers=1):
            attn, experts = times[threads]
            if micro_batch < len(requests):
                attn, experts = attn / 2, experts * expert_share_at_half
            if expert_workers > 1:
                experts = times[threads][1] * half_the_experts
            return {"micro_batch": micro_batch, "attn_ms": attn, "experts_ms": experts}
        return fake

    # Stages that halve with the batch, two threads barely helping (a busy machine): two one-thread workers
    # overlapping their stages win.
    monkeypatch.setattr(bench, "stage_probe", probe({2: (7.0, 8.0), 1: (8.0, 9.0)}))
    choice = choose_layout(spec, requests, max_new_tokens=4, cores=2)
    assert choice["chosen"] == "disaggregated_1+1_m2"
    assert choice["layout"] == dict(attn_workers=1, expert_workers=1, micro_batches=2, threads=1)
    assert all(name in choice["summary"] for name in ("disaggregated_1+1_m2", "colocated_1", "colocated_1_thread_1"))
    # Experts bound by their weights: each micro-batch streams them again, and two processes streaming half
    # each are slower still (one memory bus): one process with one thread wins.
    monkeypatch.setattr(bench, "stage_probe", probe({2: (9.0, 10.0), 1: (8.0, 9.0)}, expert_share_at_half=1.0,
                                                    half_the_experts=1.5))
    choice = choose_layout(spec, requests, max_new_tokens=4, cores=2)
    assert choice["chosen"] == "colocated_1_thread_1"
    assert choice["layout"] == dict(colocated=1, micro_batches=1, order="sequential", threads=1)
    # Two threads halve each stage: one process with both cores wins (no bubble, one weight pass).
    monkeypatch.setattr(bench, "stage_probe", probe({2: (2.0, 4.0), 1: (6.0, 14.0)}))
    choice = choose_layout(spec, requests, max_new_tokens=4, cores=2)
    assert choice["layout"] == dict(colocated=1, micro_batches=1, order="sequential", threads=2)
    # Two threads only a little faster than the best one-thread layout: not enough (they stall each other on a
    # shared machine).
    monkeypatch.setattr(bench, "stage_probe", probe({2: (4.0, 8.4), 1: (8.0, 16.0)}))
    choice = choose_layout(spec, requests, max_new_tokens=4, cores=2)
    assert choice["chosen"] == "disaggregated_1+1_m2" and "not 1.3x faster" in choice["summary"]
    # Each of two processes streams half the experts' weights at full speed: EP across two colocated
    # processes (each attending to half the sequences) wins.
    monkeypatch.setattr(bench, "stage_probe", probe({2: (7.0, 8.0), 1: (8.0, 9.0)}, half_the_experts=0.5))
    choice = choose_layout(spec, requests, max_new_tokens=4, cores=2)
    assert choice["chosen"] == "colocated_2"
    assert choice["layout"] == dict(colocated=2, micro_batches=1, order="sequential", threads=1)
    # One core: nothing to split.
    assert choose_layout(spec, requests, max_new_tokens=4, cores=1)["chosen"] == "colocated_1"


def test_batched_decode_attention_is_bitwise_each_sequence_alone():
    """Histories of different lengths padded to the longest give every sequence exactly its single-sequence
    attention (padding the keys of the score product changed some scores' last bits, and greedy tokens)."""
    import torch

    from mbridge_epoverlap.serving.model.kv_cache import cached_attention, decode_attention

    generator = torch.Generator().manual_seed(0)
    batch, heads, groups, dim, longest = 24, 8, 2, 64, 150
    q = torch.randn(batch, heads, dim, generator=generator)
    k = torch.randn(batch, groups, longest, dim, generator=generator)
    v = torch.randn(batch, groups, longest, dim, generator=generator)
    lengths = torch.randint(90, longest + 1, (batch,), generator=generator)
    lengths[1] = lengths[0]  # two sequences of one length share a product
    out = decode_attention(q, k, v, lengths)
    for b in range(batch):
        n = int(lengths[b])
        alone = cached_attention(q[b:b + 1], k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1),
                                 torch.tensor([n - 1]))
        assert torch.equal(out[b], alone[0]), f"sequence {b} (length {n})"
