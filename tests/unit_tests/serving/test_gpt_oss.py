"""GPT-OSS (`serving.model.architectures.gpt_oss`) decodes its checkpoints exactly as `transformers` does, and refuses
what it cannot serve before any weight is read.

On the tiny checkpoint of the serving fixtures (attention sinks, biases everywhere, sliding and full layers with a
window shorter than the longest prompt, a clamped SwiGLU whose clamp fires, YaRN rope): greedy tokens equal
`generate(do_sample=False)`, fp32 and bf16 prefill logits equal the eager model's bit for bit, experts split over
parts and the disaggregated engine give the same tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.parts import generate_reference, load_attention_part, load_expert_part
from tests.unit_tests.serving.conftest import GPT_OSS_SWIGLU_LIMIT
from tests.unit_tests.serving.engine_runs import assert_refused_before_weights, config_only, prefill_logits

MAX_NEW = 10


def test_spec_reads_what_gpt_oss_has(tiny_gpt_oss_dir) -> None:
    spec = load_spec(tiny_gpt_oss_dir)
    assert spec.architecture == "GptOssForCausalLM"
    assert spec.layer_windows == (4, None, 4) and [spec.window_of(i) for i in range(3)] == [4, None, 4]
    assert (spec.attention_sinks, spec.qkv_bias, spec.attention_out_bias, spec.router_bias, spec.expert_bias) == (
        True, True, True, True, True)
    assert (spec.router_softmax_after_topk, spec.expert_activation, spec.swiglu_limit) == (
        True, "clamped_swiglu", GPT_OSS_SWIGLU_LIMIT)
    scaling = spec.rope_scaling
    assert scaling is not None and (scaling.kind, scaling.factor, scaling.original_max_position_embeddings,
                                    scaling.truncate) == ("yarn", 4.0, 64, False)
    assert spec.rope_theta == 10000.0 and spec.expert_ffn == 32 and spec.head_dim == 16


def test_a_4x_config_with_rope_scaling_and_rope_theta_reads_the_same(tiny_gpt_oss_dir, tmp_path) -> None:
    """The released config.json is 4.x's: `rope_scaling` (no `rope_theta` in it) beside a top-level `rope_theta`."""
    directory = Path(shutil.copytree(tiny_gpt_oss_dir, tmp_path / "ckpt"))
    config = json.loads((directory / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (directory / "config.json").write_text(json.dumps(config))
    old, new = load_spec(tiny_gpt_oss_dir), load_spec(directory)
    assert (new.rope_theta, new.rope_scaling) == (old.rope_theta, old.rope_scaling)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_equal_transformers(tiny_gpt_oss_dir, truncate) -> None:
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from mbridge_epoverlap.serving.model.architectures.base import ConfigFields
    from mbridge_epoverlap.serving.model.architectures.gpt_oss import GptOss
    from mbridge_epoverlap.serving.model.layers import rotary_for

    config = AutoConfig.from_pretrained(tiny_gpt_oss_dir)
    config.rope_parameters["truncate"] = truncate
    theirs = GptOssRotaryEmbedding(config)
    raw = json.loads((tiny_gpt_oss_dir / "config.json").read_text())
    raw["rope_parameters"]["truncate"] = truncate
    scaling = GptOss._rope_scaling(ConfigFields(tiny_gpt_oss_dir / "config.json", raw))
    spec = load_spec(tiny_gpt_oss_dir)
    ours = rotary_for(type(spec)(**{**spec.__dict__, "rope_scaling": scaling}))
    assert torch.equal(ours.inv_freq, theirs.inv_freq) and ours.attention_scaling == theirs.attention_scaling
    positions = torch.arange(40)
    cos, sin = ours.cos_sin(positions)
    their_cos, their_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    half = spec.head_dim // 2
    assert torch.equal(cos[:, :half], their_cos[0]) and torch.equal(sin[:, :half], their_sin[0])


def test_the_clamp_fires_and_the_sinks_take_a_share(tiny_gpt_oss_dir, prompts) -> None:
    """The features under test change the outputs on these prompts: some gate and up entries pass the clamp,
    and the sinks take a share of the attention (the comparisons below are not vacuous)."""
    from mbridge_epoverlap.serving.model.batch import TokenBatch
    from mbridge_epoverlap.serving.model.kv_cache import KVCache

    spec = load_spec(tiny_gpt_oss_dir)
    attention, experts = load_attention_part(spec), load_expert_part(spec, range(spec.num_experts))
    cache = KVCache.for_spec(spec)
    cache.add(0)
    batch = TokenBatch.from_chunks([(0, prompts[2], 0)])
    attn = attention.attention_step(0, attention.embed(batch.token_ids), batch, cache)
    w1, b1 = experts.experts["0"].w1, experts.biases["0"].b1
    gate, up = (torch.einsum("th,efh->etf", attn.tokens, w1) + b1[:, None]).chunk(2, dim=-1)
    assert bool((gate > GPT_OSS_SWIGLU_LIMIT).any()) and bool((up.abs() > GPT_OSS_SWIGLU_LIMIT).any())
    assert float(attention.layers[0].attention.sinks.abs().max()) > 0.5


@pytest.mark.parametrize("window", [None, 3])
def test_padded_decode_attention_with_sinks_is_each_sequence_alone_to_rounding(window) -> None:
    """The engine's padded decode attention takes the sinks as the exact one does (the padding ignored)."""
    from mbridge_epoverlap.serving.model.kv_cache import decode_attention, padded_decode_attention

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 8, generator=gen)
    k, v = torch.randn(3, 2, 9, 8, generator=gen), torch.randn(3, 2, 9, 8, generator=gen)
    lengths, sinks = torch.tensor([9, 2, 6]), torch.randn(4, generator=gen) * 2
    exact = decode_attention(q, k, v, lengths, sliding_window=window, sinks=sinks)
    padded = padded_decode_attention(q, k, v, lengths, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(padded, exact, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(exact, decode_attention(q, k, v, lengths, sliding_window=window), atol=1e-3)


# Tokens, logits, split experts and the disaggregated engine: `test_architectures.py` (FAMILIES).


# --- MXFP4 experts -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mxfp4_dirs(tiny_gpt_oss_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny checkpoint with its experts quantized to MXFP4 as the released GPT-OSS checkpoints store them,
    the same model with those experts dequantized by `transformers`' own `convert_moe_packed_tensors` and saved
    as plain weights): two stores of one model, the second what `transformers` runs."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from mbridge_epoverlap.serving.model.architectures.formats.mxfp4 import quantize

    quantized = Path(shutil.copytree(tiny_gpt_oss_dir, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "q"))
    plain = Path(shutil.copytree(tiny_gpt_oss_dir, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "plain"))
    tensors = load_file(str(tiny_gpt_oss_dir / "model.safetensors"))
    packed, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize(tensors[name].transpose(1, 2))  # stored [experts, out, in / 32, 16]
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        assert not torch.equal(dequantized[name], tensors[name])  # the quantization changed the weights
    save_file(packed, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, plain


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_experts_dequantize_to_transformers_logits_bit_for_bit(mxfp4_dirs, prompts, dtype) -> None:
    quantized, plain = mxfp4_dirs
    assert load_spec(quantized).expert_quantization == "mxfp4"
    ours, expected = prefill_logits(quantized, prompts[2], dtype, reference=plain)
    assert torch.equal(ours, expected.float())


def test_mxfp4_greedy_tokens_equal_transformers_generate(mxfp4_dirs, prompts, hf_greedy) -> None:
    quantized, plain = mxfp4_dirs
    assert generate_reference(load_spec(quantized), prompts, MAX_NEW) == hf_greedy(plain, prompts, MAX_NEW)


# --- refused before any weight is read --------------------------------------------------------------

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}


@pytest.mark.parametrize(("changes", "named"), [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
     ["'rope_parameters.rope_type'", "'dynamic'"]),
    ({"rope_parameters": {**_YARN, "partial_rotary_factor": 0.5}}, ["'rope_parameters.partial_rotary_factor'", "0.5"]),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, ["'quantization_config.quant_method'", "gptq",
                                                                    "'mxfp4'"]),
    ({"quantization_config": {"quant_method": "mxfp4"}, "intermediate_size": 48}, ["'intermediate_size'", "48",
                                                                                  "'quantization_config'"]),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     ["'layer_types'", "chunked_attention"]),
])
def test_unsupported_features_exit_2_naming_field_and_value(tiny_gpt_oss_dir, changes, named, tmp_path) -> None:
    assert_refused_before_weights(config_only(tiny_gpt_oss_dir, tmp_path, **changes), named, tmp_path)


# --- elastic expert moves carry the biases ----------------------------------------------------------

def test_expert_store_builds_a_share_with_the_experts_biases(tiny_gpt_oss_dir) -> None:
    from mbridge_epoverlap.serving.model.expert_store import ExpertStore

    spec = load_spec(tiny_gpt_oss_dir)
    mine, theirs, reference = ExpertStore(spec, [0, 1]), ExpertStore(spec, [2, 3]), ExpertStore(spec, range(8))
    sent = theirs.export([3])
    assert len(sent) == 4  # w1, w2, b1, b2
    part = mine.build([1, 3], {3: tuple(t[:, 0] for t in sent)})
    assert mine.adopt(part) == [0] and mine.held == {1, 3}
    tokens, ids = torch.randn(6, spec.hidden_size), torch.tensor([1, 3, 3, 1, 3, 1])
    for layer in spec.moe_layer_ids:
        assert torch.equal(mine(layer, tokens, ids), reference(layer, tokens, ids))


def test_rebalancing_while_decoding_moves_experts_with_their_biases(tiny_gpt_oss_dir, prompts, hf_greedy) -> None:
    from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
    from tests.unit_tests.serving.engine_runs import requests_of

    max_new = 8
    plan = make_plan(load_spec(tiny_gpt_oss_dir), requests_of(prompts), expert_workers=4, micro_batches=2,
                     max_new_tokens=max_new, timeout_s=20)
    plan = make_elastic(plan, redundant=4, rebalance_every=3, rebalance_threshold=1.0)
    result = run_engine(plan, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_gpt_oss_dir, prompts, max_new)
    received = [e for e in result["elastic"]["events"] if e["event"] == "moved" and e["received"]]
    assert received  # an expert worker got weights (and biases) from another one
