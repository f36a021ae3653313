"""Qwen3-Next and Qwen3.5-MoE, hybrid models: gated DeltaNet layers (`serving.model.linear.delta_net`) whose
per-sequence states live in a `StateCache` beside the KV cache, and gated full attention.

On the tiny checkpoints of the serving fixtures (`tiny_qwen3_next_dir`, `tiny_qwen3_5_moe_dir`; the shared checks of
every family, including bit-for-bit prefill logits, are `test_architectures.py`'s): prompts longer than the
DeltaNet's 64-token block, and prompts fed in chunks as the scheduler splits them, decode to `transformers`' greedy
tokens in fp32 and bf16; the chunked form and the recurrence agree; the engine gives those tokens in every layout and
after an expert worker is lost; the state cache keeps a sequence's state apart from the others' and reports its size;
a config the engine cannot serve is refused before any weight is read.
"""

from __future__ import annotations

import random

import pytest
import torch

from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kv_cache import KVCache, kv_cache_bytes_per_token
from mbridge_epoverlap.serving.model.linear.delta_net import chunked_delta_rule, delta_rule_step
from mbridge_epoverlap.serving.model.linear.state_cache import StateCache, state_bytes_per_sequence
from mbridge_epoverlap.serving.model.parts import LocalModel, generate_reference, load_attention_part, load_expert_part
from mbridge_epoverlap.serving.model.spec import GatedDeltaNet
from tests.unit_tests.serving.conftest import TINY_VOCAB
from tests.unit_tests.serving.engine_runs import (
    assert_refused_before_weights,
    config_only,
    engine_tokens,
    tokens_after_a_lost_expert_worker,
)

MAX_NEW = 8


def _long_prompts() -> list[list[int]]:
    """Lengths around the DeltaNet's 64-token block (one short of it, exactly it, one past, two blocks and more)
    and a prompt of one token (the chunked form on a single token, then the recurrence)."""
    rng = random.Random(5)
    return [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (63, 64, 65, 150)] + [[42]]


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    return _long_prompts()


def test_spec_reads_the_hybrid_layout(tiny_qwen3_next_dir) -> None:
    spec = load_spec(tiny_qwen3_next_dir)
    assert spec.architecture == "Qwen3NextForCausalLM"
    assert spec.linear_layers == (True, True, True, False) and spec.moe_layers == (True, False, True, True)
    assert spec.linear_attention == GatedDeltaNet(num_key_heads=2, num_value_heads=4, key_head_dim=8,
                                                  value_head_dim=8, conv_kernel=4)
    assert (spec.rotary_dim, spec.attention_output_gate, spec.norm_zero_centred, spec.qk_norm) == (4, True, True, True)
    assert (spec.shared_expert_ffn, spec.shared_expert_gate, spec.norm_topk_prob) == (24, True, True)
    # per sequence: 3 layers x (a 64-channel window of 4 fp32 inputs + 4 heads of 8 x 8 fp32 states)
    assert state_bytes_per_sequence(spec) == 3 * (64 * 4 * 4 + 4 * 8 * 8 * 4) == 6144
    assert kv_cache_bytes_per_token(spec) == 1 * 2 * 2 * 16 * 4  # only the full-attention layer keeps keys
    assert "3 linear attention" in spec.describe()


def test_qwen3_5_moe_spec_reads_its_separate_projections(tiny_qwen3_5_moe_dir) -> None:
    spec = load_spec(tiny_qwen3_5_moe_dir)
    assert spec.architecture == "Qwen3_5MoeForCausalLM" and all(spec.moe_layers) and spec.dense_ffn == 0
    assert spec.linear_layers == (True, True, True, False) and spec.norm_topk_prob
    assert spec.linear_attention == GatedDeltaNet(2, 4, 8, 8, 4, grouped=False)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompts_across_the_deltanet_block_equal_transformers(family, request, long_prompts, hf_greedy,
                                                              dtype) -> None:
    directory = request.getfixturevalue(f"tiny_{family}_dir")
    spec = load_spec(directory, dtype=dtype)
    ours = generate_reference(spec, long_prompts, MAX_NEW)
    theirs = hf_greedy(directory, long_prompts, MAX_NEW) if dtype == "float32" else _bf16_greedy(
        directory, long_prompts)
    assert ours == theirs
    assert len({tuple(o) for o in ours}) == len(long_prompts)


def _bf16_greedy(directory, prompts: list[list[int]]) -> list[list[int]]:
    """`transformers`' greedy tokens with the checkpoint loaded in bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                 experts_implementation="eager", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)[0, len(p):]
                .tolist() for p in prompts]


def test_a_prompt_fed_in_chunks_continues_from_its_state(tiny_qwen3_next_dir, long_prompts, hf_greedy) -> None:
    """A prompt fed as the scheduler splits it (chunks of 7, 1 and 50 tokens: within a block, a single token, across
    the 64-token block) continues each chunk from the convolution window and state the last one left, and decodes
    to the tokens of the whole prompt."""
    spec = load_spec(tiny_qwen3_next_dir)
    model = LocalModel(load_attention_part(spec), [load_expert_part(spec, range(spec.num_experts))])
    prompt = long_prompts[3]
    cache = KVCache.for_spec(spec)
    cache.add(0)
    start, out = 0, []
    for size in (7, 1, 50, len(prompt) - 58):
        token = model.next_tokens(TokenBatch.from_chunks([(0, prompt[start:start + size], start)]), cache)[0]
        start += size
    assert start == len(prompt)
    out.append(token)
    while len(out) < MAX_NEW:
        out.append(model.next_tokens(TokenBatch.from_chunks([(0, [out[-1]], len(prompt) + len(out) - 1)]), cache)[0])
    assert out == hf_greedy(tiny_qwen3_next_dir, [prompt], MAX_NEW)[0]


def test_the_chunked_form_and_the_recurrence_agree() -> None:
    """The same 100 tokens (two value heads per key head) through the chunked form at once, in two pieces carrying
    the state, and one token at a time: the same outputs and final state to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    length = 100
    q, k = (torch.randn(1, length, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, length, 4, 8, generator=g)
    decay = -torch.rand(1, length, 4, generator=g)
    beta = torch.rand(1, length, 4, generator=g)
    whole, state = chunked_delta_rule(q, k, v, decay, beta, None)
    first, mid = chunked_delta_rule(q[:, :37], k[:, :37], v[:, :37], decay[:, :37], beta[:, :37], None)
    rest, end = chunked_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], decay[:, 37:], beta[:, 37:], mid)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(end, state, rtol=1e-5, atol=1e-5)
    s = torch.zeros(1, 4, 8, 8)
    steps = []
    for t in range(length):
        out, s = delta_rule_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], decay[:, t:t + 1], beta[:, t:t + 1], s)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, state, rtol=1e-4, atol=1e-5)
    assert whole.abs().max() > 0.1  # not a vacuous agreement of zeros


def test_the_workers_arithmetic_equals_the_exact_one_to_rounding(tiny_qwen3_next_dir, long_prompts) -> None:
    """The engine's DeltaNet (`exact` False: convolution as multiply-adds, the state read once and updated in place)
    gives the exact path's outputs to fp32 rounding, with the decoding sequences' rows one range in the cache and
    not (a freed row moved the last sequence; one sequence still prefilling beside them)."""
    spec = load_spec(tiny_qwen3_next_dir)
    part = load_attention_part(spec)
    layer = spec.linear_layer_ids[1]
    block = part.layers[layer]
    caches = [KVCache.for_spec(spec), KVCache.for_spec(spec)]
    prompts = long_prompts[:4]
    for cache in caches:
        for seq in range(5):
            cache.add(seq)
        cache.free(1)  # sequence 4 moves into row 1: rows 0, 1, 2, 3 hold sequences 0, 4, 2, 3
    steps = [[(seq, prompts[i][:20 + i], 0) for i, seq in enumerate((0, 4, 2, 3))],
             [(0, [7], 20), (4, [8], 21), (2, [9], 22), (3, [10], 23)],  # all four decode: one range of rows
             [(0, [11], 21), (2, [12], 23), (4, prompts[1][21:30], 22)]]  # rows 0 and 2 decode, 4 prefills
    for chunks in steps:
        batch = TokenBatch.from_chunks(chunks)
        x = block.input_norm(part.embed(batch.token_ids))
        out = []
        for exact, cache in zip((True, False), caches, strict=True):
            block.attention.exact = exact
            out.append(block.attention.attend(layer, x, batch, cache.states))
        torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    for seq in (0, 2, 3, 4):
        exact, fast = (c.states.read(layer, c.states.rows_of([seq])) for c in caches)
        torch.testing.assert_close(fast[1], exact[1], rtol=1e-5, atol=1e-5)
        assert torch.equal(fast[0], exact[0])  # the same convolution windows


def test_the_state_cache_keeps_sequences_apart(tiny_qwen3_next_dir) -> None:
    """Rows are given back on free and a reused row starts from zeros; more sequences than the first rows grow the
    cache without moving the others' states; a micro-batch's `empty_like` cache has states of its own."""
    spec = load_spec(tiny_qwen3_next_dir)
    states = StateCache(spec)
    layer = spec.linear_layer_ids[0]
    for seq in range(12):  # past the 8 initial rows
        states.add(seq)
        rows = states.rows_of([seq])
        conv, state = states.read(layer, rows)
        states.write(layer, [seq], rows, conv + seq, state + seq, [3])
    for seq in range(12):
        conv, state = states.read(layer, states.rows_of([seq]))
        assert bool((conv == seq).all()) and bool((state == seq).all()) and states.fed(seq, layer) == 3
    states.free(4)  # sequence 11 moves into its row
    conv, state = states.read(layer, states.rows_of([11]))
    assert bool((conv == 11).all()) and bool((state == 11).all()) and states.rows_of([11]).item() == 4
    states.add(40)
    conv, state = states.read(layer, states.rows_of([40]))
    assert not conv.any() and not state.any() and states.fed(40, layer) == 0
    with pytest.raises(ValueError, match="already"):
        states.add(40)
    with pytest.raises(KeyError, match="not in the state cache"):
        states.free(4)
    cache = KVCache.for_spec(spec)
    assert cache.states is not None and cache.empty_like().states is not cache.states
    cache.add(1)
    assert 1 in cache.states
    cache.free(1)
    assert 1 not in cache.states


# With `test_nemotron_h.py`'s layouts (colocated, two attention workers) and the disaggregated m = 2 of
# `test_architectures.py`, every layout runs a state model; the states are the attention side's in each.
@pytest.mark.parametrize(("family", "layout"), [
    ("qwen3_next", {"micro_batches": 1, "expert_workers": 1}),
    ("qwen3_next", {"micro_batches": 3, "expert_workers": 2}),
    ("qwen3_next", {"colocated": 1, "micro_batches": 1, "replicated_experts": True}),
], ids=["disaggregated-m1", "disaggregated-m3", "replicated"])
def test_every_layout_gives_transformers_tokens(family, request, long_prompts, prompts, hf_greedy, layout) -> None:
    """The states live on the attention side: each layout (micro-batches with their own caches, several attention
    workers, colocated and replicated experts) decodes long and short prompts together to the same tokens."""
    directory = request.getfixturevalue(f"tiny_{family}_dir")
    batch = long_prompts + prompts
    assert engine_tokens(directory, batch, 5, **layout) == hf_greedy(directory, batch, 5)


def test_a_lost_expert_worker_leaves_the_states_whole(tiny_qwen3_next_dir, long_prompts, hf_greedy) -> None:
    """Elastic serving: an expert worker SIGKILLed mid-decode; the DeltaNet states live on the attention worker, so
    every sequence carries on from them on the surviving copies of its experts, to `transformers`' tokens."""
    tokens = tokens_after_a_lost_expert_worker(tiny_qwen3_next_dir, long_prompts, 8)
    assert tokens == hf_greedy(tiny_qwen3_next_dir, long_prompts, 8)


def test_serve_reports_the_state_bytes_beside_the_kv_bytes(tiny_qwen3_next_dir, tmp_path, capsys) -> None:
    """`serve --prompts` answers, and its JSON and table say
    what a sequence's states take beside what a token takes in the KV cache."""
    import json

    from mbridge_epoverlap.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": [5, 6, 7, 8]}) + "\n")
    base = ["serve", "--checkpoint", str(tiny_qwen3_next_dir), "--prompts", str(prompts), "--max-new-tokens", "3",
            "--colocated", "1"]
    assert main([*base, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["state_bytes_per_sequence"] == 6144 and result["kv_cache_bytes_per_token"] == 256
    assert main(base) == 0
    assert "KV cache" in (table := capsys.readouterr().out) and "states 6,144 bytes per sequence" in table


def test_online_plans_keep_no_prefix_cache_for_a_hybrid_model(tiny_qwen3_next_dir, tiny_nemotron_h_dir,
                                                               tiny_mixtral_dir) -> None:
    """Cached key and value blocks cannot restore a sequence's DeltaNet or Mamba-2 state: a hybrid model's plan has
    no prefix cache however much is asked, another model's keeps it."""
    from mbridge_epoverlap.serving.engine.run import make_plan

    def cache_bytes(directory):
        return make_plan(load_spec(directory), [], colocated=1, micro_batches=1, online_requests=["tcp://x:1"],
                         online_events="tcp://x:2", max_model_len=64, prefix_cache_bytes=1 << 20).prefix_cache_bytes

    assert cache_bytes(tiny_qwen3_next_dir) == cache_bytes(tiny_nemotron_h_dir) == 0
    assert cache_bytes(tiny_mixtral_dir) == 1 << 20


@pytest.mark.parametrize(("changes", "named"), [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     ["'layer_types'", "'sliding_attention'", "layer 1"]),
    ({"layer_types": ["linear_attention", "full_attention"]}, ["'layer_types'", "4 layer kinds"]),
    ({"linear_num_value_heads": 3}, ["'linear_num_value_heads' (3)", "'linear_num_key_heads' (2)"]),
    ({"linear_conv_kernel_dim": 0}, ["'linear_conv_kernel_dim'", "is 0"]),
    ({"attention_bias": True}, ["'attention_bias'", "True"]),
    ({"rope_parameters.partial_rotary_factor": 0.1}, ["'rope_parameters.partial_rotary_factor'", "0.1"]),
])
def test_what_the_engine_cannot_serve_is_named_before_weights_load(tiny_qwen3_next_dir, tmp_path, changes,
                                                                   named) -> None:
    assert_refused_before_weights(config_only(tiny_qwen3_next_dir, tmp_path, **changes), named, tmp_path)
