"""Nemotron-H, a hybrid of single blocks: Mamba-2 (`serving.model.linear.mamba2`, its state in the `StateCache`),
attention without rope, and relu^2 MoE and MLP blocks, paired into the engine's mixer-then-MLP layers.

On the tiny checkpoint of the serving fixtures (`tiny_nemotron_h_dir`, 8 blocks: a layer of each pairing; the shared
checks of every family, including bit-for-bit prefill logits, are `test_architectures.py`'s): the blocks pair as
described; prompts longer than the scan's 16-token chunk, and prompts fed in chunks, decode to `transformers`' greedy
tokens; the chunked scan and the recurrence agree; the engine gives those tokens in its layouts (an expert worker
lost: `test_qwen3_next.py`, the same state cache); the older `hybrid_override_pattern` config reads the same; what the
engine cannot serve is refused before any weight is read.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.serving.model.architectures.nemotron_h import pair_blocks
from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kv_cache import KVCache, kv_cache_bytes_per_token
from mbridge_epoverlap.serving.model.linear.mamba2 import chunked_scan, scan_step
from mbridge_epoverlap.serving.model.linear.state_cache import state_bytes_per_sequence
from mbridge_epoverlap.serving.model.parts import LocalModel, generate_reference, load_attention_part, load_expert_part
from mbridge_epoverlap.serving.model.spec import Mamba2
from tests.unit_tests.serving.conftest import TINY_VOCAB
from tests.unit_tests.serving.engine_runs import (
    assert_refused_before_weights,
    config_only,
    engine_tokens,
)

MAX_NEW = 8


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    """Lengths around the 16-token scan chunk and several chunks long, and a one-token prompt."""
    rng = random.Random(8)
    return [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (15, 16, 17, 70)] + [[42]]


def test_blocks_pair_into_mixer_then_mlp_layers() -> None:
    assert pair_blocks(["linear_attention", "moe", "full_attention", "moe"]) == [(0, 1), (2, 3)]
    # two mixers in a row: the first alone; two MLPs in a row: the second alone; a leading MLP alone
    assert pair_blocks(["mlp", "linear_attention", "linear_attention", "moe", "mlp"]) == [
        (-1, 0), (1, -1), (2, 3), (-1, 4)]


def test_spec_reads_the_blocks(tiny_nemotron_h_dir) -> None:
    spec = load_spec(tiny_nemotron_h_dir)
    assert spec.architecture == "NemotronHForCausalLM" and spec.num_layers == 5
    assert spec.blocks == ((0, 1), (2, 3), (4, -1), (5, 6), (-1, 7))
    assert spec.mamba_layers == (True, False, True, True, False)
    assert spec.moe_layers == (True, True, False, False, True)
    assert [spec.has_mixer(i) for i in range(5)] == [True, True, True, True, False]
    assert [spec.has_ffn(i) for i in range(5)] == [True, True, False, True, True]
    assert spec.mamba == Mamba2(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4, chunk_size=16)
    assert (spec.expert_activation, spec.mlp_activation, spec.rope, spec.dense_ffn, spec.shared_expert_ffn) == (
        "relu2", "relu2", False, 40, 20)
    assert spec.grouped_routing is not None and spec.grouped_routing.routed_scaling_factor == 1.5
    # per sequence: 3 Mamba-2 layers x (a 96-channel window of 4 fp32 inputs + 4 heads of 8 x 16 fp32 states)
    assert state_bytes_per_sequence(spec) == 3 * (96 * 4 * 4 + 4 * 8 * 16 * 4) == 10752
    assert kv_cache_bytes_per_token(spec) == 2 * 2 * 8 * 4  # the one attention layer
    assert "3 Mamba-2" in spec.describe()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompts_across_scan_chunks_equal_transformers(tiny_nemotron_h_dir, long_prompts, hf_greedy, dtype) -> None:
    ours = generate_reference(load_spec(tiny_nemotron_h_dir, dtype=dtype), long_prompts, MAX_NEW)
    if dtype == "float32":
        theirs = hf_greedy(tiny_nemotron_h_dir, long_prompts, MAX_NEW)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_nemotron_h_dir, attn_implementation="eager",
                                                     experts_implementation="eager", dtype=torch.bfloat16).eval()
        with torch.no_grad():
            theirs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW,
                                     pad_token_id=0)[0, len(p):].tolist() for p in long_prompts]
    assert ours == theirs
    assert len({tuple(o) for o in ours}) == len(long_prompts)


def test_a_prompt_fed_in_chunks_continues_from_its_state(tiny_nemotron_h_dir, long_prompts, hf_greedy) -> None:
    spec = load_spec(tiny_nemotron_h_dir)
    model = LocalModel(load_attention_part(spec), [load_expert_part(spec, range(spec.num_experts))])
    prompt = long_prompts[3]
    cache = KVCache.for_spec(spec)
    cache.add(0)
    start = 0
    for size in (7, 1, 30, len(prompt) - 38):  # within a chunk, one token, across chunks
        token = model.next_tokens(TokenBatch.from_chunks([(0, prompt[start:start + size], start)]), cache)[0]
        start += size
    out = [token]
    while len(out) < MAX_NEW:
        out.append(model.next_tokens(TokenBatch.from_chunks([(0, [out[-1]], len(prompt) + len(out) - 1)]), cache)[0])
    assert out == hf_greedy(tiny_nemotron_h_dir, [prompt], MAX_NEW)[0]


def test_the_chunked_scan_and_the_recurrence_agree() -> None:
    """50 tokens (two heads per group) at once, in two pieces carrying the state, and one token at a time."""
    g = torch.Generator().manual_seed(0)
    m = Mamba2(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4, chunk_size=16)
    n = 50
    x = torch.randn(n, 4, 8, generator=g)
    dt = torch.randn(n, 4, generator=g)
    b, c = torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g)
    a, d, bias = -torch.rand(4, generator=g) - 0.1, torch.randn(4, generator=g), torch.randn(4, generator=g)
    whole, state = chunked_scan(x[None], dt[None], a, b[None], c[None], d, bias, m, None)
    whole, state = whole[0], state[0]
    first, mid = chunked_scan(x[None, :21], dt[None, :21], a, b[None, :21], c[None, :21], d, bias, m, None)
    rest, end = chunked_scan(x[None, 21:], dt[None, 21:], a, b[None, 21:], c[None, 21:], d, bias, m, mid)
    torch.testing.assert_close(torch.cat([first[0], rest[0]]), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(end[0], state, rtol=1e-5, atol=1e-5)
    s, steps = torch.zeros(1, 4, 8, 16), []
    for t in range(n):
        y, s = scan_step(s, x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], d, bias)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s[0], state, rtol=1e-4, atol=1e-4)
    assert whole.abs().max() > 0.1


# Disaggregated m = 1, 3 and replicated experts: `test_qwen3_next.py`; m = 2: `test_architectures.py`.
@pytest.mark.parametrize("layout", [
    {"attn_workers": 2, "micro_batches": 2, "expert_workers": 1},
    {"colocated": 2, "micro_batches": 2},
], ids=["two-attention-workers", "colocated"])
def test_every_layout_gives_transformers_tokens(tiny_nemotron_h_dir, long_prompts, prompts, hf_greedy,
                                                layout) -> None:
    batch = long_prompts + prompts
    assert engine_tokens(tiny_nemotron_h_dir, batch, 5, **layout) == hf_greedy(tiny_nemotron_h_dir, batch, 5)


def test_the_older_pattern_config_reads_the_same(tiny_nemotron_h_dir, tmp_path) -> None:
    """Released Nemotron-H configs name the blocks in `hybrid_override_pattern` (M, *, E, -) and some sizes by older
    names (`mamba_n_groups`, `mamba_d_conv`, `n_routed_experts`): the same spec."""
    directory = Path(shutil.copytree(tiny_nemotron_h_dir, tmp_path / "ckpt"))
    config = json.loads((directory / "config.json").read_text())
    del config["layers_block_type"]
    config["hybrid_override_pattern"] = "ME*EMM-E"
    config["mamba_n_groups"], config["mamba_d_conv"] = config.pop("n_groups"), config.pop("conv_kernel")
    (directory / "config.json").write_text(json.dumps(config))
    old, new = load_spec(directory), load_spec(tiny_nemotron_h_dir)
    assert (old.blocks, old.mamba, old.moe_layers) == (new.blocks, new.mamba, new.moe_layers)


@pytest.mark.parametrize(("changes", "named"), [
    ({"layers_block_type": ["linear_attention", "moe", "sliding_attention"]},
     ["'layers_block_type'", "'sliding_attention'", "block 2"]),
    ({"moe_latent_size": 16}, ["'moe_latent_size'", "16"]),
    ({"mlp_hidden_act": "gelu"}, ["'mlp_hidden_act'", "'gelu'"]),
    ({"mamba_num_heads": 3}, ["'mamba_num_heads' (3)", "'n_groups' (2)"]),
    ({"time_step_limit": [1.0, 0.5]}, ["'time_step_limit'", "low <= high"]),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     ["'quantization_config.quant_method'", "'fp8'"]),
])
def test_what_the_engine_cannot_serve_is_named_before_weights_load(tiny_nemotron_h_dir, tmp_path, changes,
                                                                   named) -> None:
    assert_refused_before_weights(config_only(tiny_nemotron_h_dir, tmp_path, **changes), named, tmp_path)
