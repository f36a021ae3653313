"""The serving model decodes exactly as `transformers` does, however its experts and batches are split."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kv_cache import KVCache
from mbridge_epoverlap.serving.model.parts import (
    LocalModel,
    generate_reference,
    load_attention_part,
    load_expert_part,
)
from tests.unit_tests.serving.engine_runs import prefill_logits

MAX_NEW = 10


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def checkpoint(request: pytest.FixtureRequest):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def test_greedy_tokens_equal_transformers_generate(checkpoint, prompts, hf_greedy) -> None:
    spec = load_spec(checkpoint)
    ours = generate_reference(spec, prompts, MAX_NEW)
    assert ours == hf_greedy(checkpoint, prompts, MAX_NEW)
    # The prompts decode to different continuations, so the comparison is not vacuous.
    assert len({tuple(o) for o in ours}) == len(prompts)


def test_logits_equal_transformers_bit_for_bit(tiny_qwen3_moe_dir, prompts) -> None:
    ours, expected = prefill_logits(tiny_qwen3_moe_dir, prompts[2], "float32")
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_logits_equal_transformers_bit_for_bit(family, prompts, request) -> None:
    """In bf16 Qwen3-MoE rounds the chosen router probabilities to bf16 before weighting the expert outputs and
    Mixtral does not: with fp32 weights the Qwen3-MoE engine agreed with `transformers` on 1 of 64 sequences of
    the serving benchmark."""
    ours, expected = prefill_logits(request.getfixturevalue(f"tiny_{family}_dir"), prompts[2], "bfloat16")
    assert torch.equal(ours, expected.float())


@pytest.mark.parametrize("groups", [None, [[0, 2], [1, 3]]])
def test_each_expert_gets_its_rows_in_transformers_order(tiny_mixtral_dir, monkeypatch, groups) -> None:
    """`transformers`' eager experts take an expert's rows slot-major (`torch.where` over [slot, token]); a GEMM
    may round a row by its position in it on some CPUs, so the reference gives each expert the same order."""
    from mbridge_epoverlap.serving.model import parts

    spec = load_spec(tiny_mixtral_dir)
    experts = [load_expert_part(spec, g) for g in (groups or [range(spec.num_experts)])]
    ids = torch.tensor([[2, 0], [0, 1], [1, 2], [0, 3], [3, 2]])  # expert 0: token 1, 3 first, then token 0
    tokens = torch.randn(len(ids), spec.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = spec.moe_layer_ids[0]
    seen: dict[int, torch.Tensor] = {}
    grouped = parts.grouped_expert_swiglu

    def spy(x, w1, w2, counts):
        part = next(p for p in experts if p.experts[str(layer)].w1 is w1)
        starts = torch.tensor([0, *counts]).cumsum(0).tolist()
        for expert, start, end in zip(part.expert_ids, starts, starts[1:], strict=False):
            seen[expert] = x[start:end]
        return grouped(x, w1, w2, counts)

    monkeypatch.setattr(parts, "grouped_expert_swiglu", spy)
    attn = parts.AttnOut(resid=tokens, tokens=tokens, expert_ids=ids, gate_weights=torch.ones(ids.shape))
    parts.run_experts(experts, layer, attn)
    mask = torch.nn.functional.one_hot(ids, spec.num_experts).permute(2, 1, 0)  # as transformers builds it
    for expert in range(spec.num_experts):
        slot_then_token = torch.where(mask[expert])[1]
        assert torch.equal(seen[expert], tokens[slot_then_token]), f"expert {expert}"


@pytest.mark.parametrize("groups", [[[0, 2], [1, 3]], [[3], [0, 1], [2]]])
def test_experts_split_over_parts_give_the_same_tokens(tiny_mixtral_dir, prompts, groups) -> None:
    spec = load_spec(tiny_mixtral_dir)
    assert generate_reference(spec, prompts, MAX_NEW, expert_groups=groups) == generate_reference(
        spec, prompts, MAX_NEW)


def test_qwen3_experts_in_three_parts(tiny_qwen3_moe_dir, prompts) -> None:
    spec = load_spec(tiny_qwen3_moe_dir)
    groups = [[7, 0, 5], [1, 6], [2, 3, 4]]
    assert generate_reference(spec, prompts, MAX_NEW, expert_groups=groups) == generate_reference(
        spec, prompts, MAX_NEW)


def test_eos_stops_a_sequence_and_is_kept(tiny_mixtral_dir, prompts, hf_greedy) -> None:
    spec = load_spec(tiny_mixtral_dir)
    free = generate_reference(dataclasses.replace(spec, eos_token_ids=()), prompts, MAX_NEW)
    eos = free[0][3]  # a token the first prompt produces as its 4th new token
    stopped = generate_reference(dataclasses.replace(spec, eos_token_ids=(eos,)), prompts, MAX_NEW)
    for before, after in zip(free, stopped, strict=True):
        cut = before.index(eos) + 1 if eos in before else len(before)
        assert after == before[:cut]
    assert len(stopped[0]) <= 4 < MAX_NEW
    assert stopped == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW, eos_token_id=eos)


def test_checkpoint_eos_id_is_read_from_generation_config(tiny_qwen3_moe_dir) -> None:
    assert load_spec(tiny_qwen3_moe_dir).eos_token_ids == (3,)


def test_continuous_batching_gives_the_tokens_of_one_sequence_at_a_time(checkpoint, prompts) -> None:
    """Sequences join at different steps, long prompts are prefilled in chunks beside others' decode
    tokens, and finished sequences leave: every sequence still gets its single-sequence tokens."""
    spec = load_spec(checkpoint)
    model = LocalModel(load_attention_part(spec), [load_expert_part(spec, range(spec.num_experts))])
    alone = [model.generate([p], MAX_NEW)[0] for p in prompts]

    cache = KVCache.for_spec(spec)
    joins = {0: [0, 1], 2: [2], 3: [3]}  # step -> sequences that arrive then
    chunk = 4  # prefill at most this many prompt tokens per sequence per step
    fed = {}  # seq -> prompt tokens already in the cache
    outputs: dict[int, list[int]] = {}
    mixed_steps = 0
    for step in range(100):
        for seq in joins.get(step, []):
            cache.add(seq)
            fed[seq], outputs[seq] = 0, []
        chunks = []
        for seq in sorted(fed):
            prompt = prompts[seq]
            if fed[seq] < len(prompt):
                chunks.append((seq, prompt[fed[seq]:fed[seq] + chunk], fed[seq]))
            elif seq in cache:
                chunks.append((seq, [outputs[seq][-1]], len(prompt) + len(outputs[seq]) - 1))
        if not chunks and step > max(joins):
            break
        if not chunks:
            continue
        batch = TokenBatch.from_chunks(chunks)
        mixed_steps += any(len(c[1]) > 1 for c in chunks) and any(len(c[1]) == 1 for c in chunks)
        next_tokens = model.next_tokens(batch, cache)
        for seq, tokens, _start in chunks:
            if seq not in fed or fed[seq] < len(prompts[seq]):
                fed[seq] += len(tokens)
                if fed[seq] < len(prompts[seq]):
                    continue  # a middle chunk of a prompt: no token is sampled from it
            outputs[seq].append(next_tokens[seq])
            if len(outputs[seq]) == MAX_NEW or outputs[seq][-1] in spec.eos_token_ids:
                cache.free(seq)
    assert mixed_steps > 0  # prefill chunks and decode tokens really shared a batch
    assert [outputs[s] for s in range(len(prompts))] == alone


def test_batch_rejects_a_sequence_split_in_two_runs() -> None:
    with pytest.raises(ValueError, match="two separate runs"):
        TokenBatch(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 0]), torch.tensor([0, 0, 1]))


def test_cache_rejects_a_gap_in_positions(tiny_mixtral_dir) -> None:
    spec = load_spec(tiny_mixtral_dir)
    part = load_attention_part(spec)
    cache = KVCache.for_spec(spec)
    cache.add(7)
    batch = TokenBatch.from_chunks([(7, [4, 5], 3)])
    with pytest.raises(ValueError, match="start at position 3 but the cache holds 0"):
        part.attention_step(0, part.embed(batch.token_ids), batch, cache)


def test_sliding_window_attention_equals_transformers(tmp_path_factory, prompts, hf_greedy) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(99)
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           initializer_range=0.1, sliding_window=4, eos_token_id=None)
    directory = tmp_path_factory.mktemp("tiny_mixtral_window")
    MixtralForCausalLM(config).save_pretrained(directory)
    spec = load_spec(directory)
    assert spec.sliding_window == 4
    ours = generate_reference(spec, prompts, MAX_NEW)
    assert ours == hf_greedy(directory, prompts, MAX_NEW)
    # The window matters: without it the long prompt continues differently.
    assert ours != generate_reference(dataclasses.replace(spec, sliding_window=None), prompts, MAX_NEW)


def test_a_prompt_longer_than_the_first_cache_buffer(tiny_qwen3_moe_dir, hf_greedy) -> None:
    long_prompt = [(7 * i + 3) % 128 for i in range(70)]  # the cache buffer starts at 64 positions
    spec = load_spec(tiny_qwen3_moe_dir)
    assert generate_reference(spec, [long_prompt], MAX_NEW) == hf_greedy(tiny_qwen3_moe_dir, [long_prompt], MAX_NEW)
