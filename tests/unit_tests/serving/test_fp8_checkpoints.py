"""FP8 block-scaled checkpoints (`architectures.formats.fp8`), as DeepSeek-V3, Kimi K2 and the `-FP8` releases of
Qwen3 and GLM-4.5 ship them, served in every layout with `transformers`' tokens on the dequantized weights.

The tiny DeepSeek-V3 in blocks of [16, 16] (partial last blocks), sharded with an index, and the tiny GLM-4.5 in the
released [128, 128] blocks (`conftest._fp8_pair`); the reference is `transformers` greedy on a float checkpoint of
what the FP8 one means (each weight its FP8 values times their block's scale, computed in the fixture). What the
engine cannot read is refused before any weight is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.architectures.formats import fp8
from mbridge_epoverlap.serving.model.checkpoint import CheckpointReader, load_spec
from tests.unit_tests.serving.engine_runs import assert_refused_before_weights, leftovers, requests_of

MAX_NEW = 6


def test_dequantize_equals_transformers_fp8_dequantize() -> None:
    """Whole blocks: the same values as `transformers`' CPU dequantization (its `Fp8Dequantize`); partial last
    blocks (which it cannot take: it derives the block from the grid) take their block's scale."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 384, generator=gen)
    q, s = fp8.quantize(weight, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    assert torch.equal(fp8.dequantize(q, s, (128, 128)), theirs)
    torch.testing.assert_close(theirs, weight, rtol=0.07, atol=s.max().item())  # within e4m3's spacing
    odd = torch.randn(40, 24, generator=gen)
    q, s = fp8.quantize(odd, (16, 16))
    assert s.shape == (3, 2)
    values = fp8.dequantize(q, s, (16, 16))
    assert torch.equal(values[33, 20], q[33, 20].float() * s[2, 1])
    # rows 20..37 of the weight from their own scale rows (1 and 2), as an expert of a fused tensor is read
    assert torch.equal(fp8.dequantize(q[20:38], s[1:3], (16, 16), first_row=20), values[20:38])


def test_spec_and_reader_of_a_sharded_fp8_checkpoint(tiny_deepseek_v3_fp8) -> None:
    quantized, reference = tiny_deepseek_v3_fp8
    spec = load_spec(quantized)
    assert spec.fp8_block == (16, 16) and load_spec(reference).fp8_block is None
    assert (quantized / "model.safetensors.index.json").is_file() and len(list(quantized.glob("*.safetensors"))) > 2
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    with CheckpointReader(spec) as reader, CheckpointReader(load_spec(reference)) as floats:
        assert reader.is_fp8(expert) and not reader.is_fp8("model.layers.1.mlp.gate.weight")
        assert torch.equal(reader.get(expert), floats.get(expert))
        assert torch.equal(reader.rows(expert, 5, 30), floats.get(expert)[5:30])


# (fixture, layout): every layout on the sharded DeepSeek-V3 in small blocks, two on GLM-4.5 in released blocks
LAYOUTS = [("tiny_deepseek_v3_fp8", dict(micro_batches=1)),
           ("tiny_deepseek_v3_fp8", dict(micro_batches=2, expert_workers=2)),
           ("tiny_deepseek_v3_fp8", dict(colocated=2)),
           ("tiny_deepseek_v3_fp8", dict(colocated=2, replicated_experts=True)),
           ("tiny_glm4_moe_fp8", dict(micro_batches=3)),
           ("tiny_glm4_moe_fp8", dict(colocated=1))]


@pytest.mark.parametrize(("fixture", "layout"), LAYOUTS,
                         ids=[f"{f.removeprefix('tiny_')}-{'-'.join(f'{k}{v}' for k, v in lay.items())}"
                              for f, lay in LAYOUTS])
def test_engine_tokens_equal_transformers_on_the_dequantized_weights(fixture, layout, request, prompts, hf_greedy):
    quantized, reference = request.getfixturevalue(fixture)
    prompts = prompts[:3]
    result = run_engine(make_plan(load_spec(quantized), requests_of(prompts), max_new_tokens=MAX_NEW, timeout_s=20,
                                  **layout))
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(reference, prompts, MAX_NEW)


def test_an_expert_worker_killed_mid_decode_reloads_its_fp8_experts(tiny_deepseek_v3_fp8, prompts, hf_greedy):
    """Elastic EP: the lost worker's experts are read again (FP8 blocks and their scales) by the survivors."""
    quantized, reference = tiny_deepseek_v3_fp8
    plan = make_plan(load_spec(quantized), requests_of(prompts[1:3]), expert_workers=4, micro_batches=2,
                     max_new_tokens=MAX_NEW, timeout_s=20)
    pids: list[int] = []
    result = run_engine(make_elastic(plan, redundant=4, kill=1, kill_step=2), on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(reference, prompts[1:3], MAX_NEW)
    assert result["elastic"]["lost_workers"] == [0] and result["failed_requests"] == []
    assert leftovers(pids) == ([], [])


def test_decode_reads_fp8_tiles_bitwise_as_the_fp32_tiles(tiny_deepseek_v3_fp8) -> None:
    """The experts of an FP8 checkpoint keep FP8 tiles; a decode step's few-row experts read them and give the bits
    the fp32 tiles give (`MBRIDGE_EPOVERLAP_QUANTIZED_TILES=0`)."""
    from mbridge_epoverlap.serving.model import packed
    from mbridge_epoverlap.serving.model.kernels import small_gemm
    from mbridge_epoverlap.serving.model.parts import load_expert_part

    if not small_gemm.available():
        pytest.skip(f"the tiled GEMMs do not run here: {small_gemm.unavailable_reason()}")
    spec = load_spec(tiny_deepseek_v3_fp8[0])
    part = load_expert_part(spec, range(spec.num_experts), packed=True)
    layer = part.packed_layers["1"]
    assert all(layer.packed_of(e).up_fp8 is not None and layer.packed_of(e).down_fp8 is not None
               for e in range(spec.num_experts))
    gen = torch.Generator().manual_seed(3)
    counts = [1, 2, 0, 1, 3, 2, 1, 5]  # FP8 tiles up to fp8_rows() rows, fp32 tiles to SMALL_ROWS, oneDNN above
    x = torch.randn(sum(counts), spec.hidden_size, generator=gen)
    fp32_only = packed.PackedExperts(layer.w1, layer.w2)
    assert torch.equal(layer.swiglu(x, counts), fp32_only.swiglu(x, counts))
    try:  # both cores share the tiled calls: FP8 tiles up to FP8_SPLIT_ROWS rows
        small_gemm.set_threads(2)
        assert torch.equal(layer.swiglu(x, counts), fp32_only.swiglu(x, counts))
    finally:
        small_gemm.set_threads(1)
    assert fp32_only.packed_of(0).up_fp8 is None


def test_bf16_serving_dequantizes_in_fp32_then_rounds(tiny_glm4_moe_fp8) -> None:
    """A bf16 model holds each dequantized weight rounded once from its fp32 value."""
    quantized, reference = tiny_glm4_moe_fp8
    name = "model.layers.1.self_attn.q_proj.weight"
    with CheckpointReader(load_spec(quantized, dtype="bfloat16")) as reader, \
            CheckpointReader(load_spec(reference)) as floats:
        assert torch.equal(reader.get(name).to(torch.bfloat16), floats.get(name).to(torch.bfloat16))


# --- refused before any weight is read --------------------------------------------------------------------------

def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize(("field", "value", "named"), [
    ("activation_scheme", "static", ["'quantization_config.activation_scheme'", "'static'", "'dynamic'"]),
    ("fmt", "e5m2", ["'quantization_config.fmt'", "'e5m2'", "'e4m3'"]),
    ("weight_block_size", [128], ["'quantization_config.weight_block_size'", "[128]"]),
    ("quant_method", "awq", ["'quantization_config.quant_method'", "'awq'", "'fp8'"]),
    ("quant_method", "gptq", ["'gptq'", "'fp8'"]),
    ("quant_method", "compressed-tensors", ["'compressed-tensors'", "'fp8'"]),
    ("quant_method", "bitsandbytes", ["'bitsandbytes'", "'fp8'"]),
])
def test_unreadable_quantization_configs_are_named(tiny_deepseek_v3_fp8, tmp_path, field, value, named) -> None:
    quantized, _ = tiny_deepseek_v3_fp8
    directory = tmp_path / "ckpt"
    directory.mkdir()
    config = _config(quantized)
    config["quantization_config"][field] = value
    (directory / "config.json").write_text(json.dumps(config))
    assert_refused_before_weights(directory, named, tmp_path)


def _rewritten(source: Path, tmp_path: Path, edit) -> Path:
    """A one-file copy of `source` whose tensors `edit` changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory = Path(shutil.copytree(source, tmp_path / "ckpt", ignore=shutil.ignore_patterns("*.safetensors*")))
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({n: handle.get_tensor(n) for n in handle.keys()})  # noqa: SIM118
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


EXPERT = "model.layers.2.mlp.experts.5.up_proj.weight"


def test_a_missing_scale_is_named(tiny_deepseek_v3_fp8, tmp_path) -> None:
    directory = _rewritten(tiny_deepseek_v3_fp8[0], tmp_path, lambda t: t.pop(fp8.scale_name(EXPERT)))
    with pytest.raises(UsageError, match=rf"{EXPERT}' is F8_E4M3 \[32, 32\] but its scale '{EXPERT}_scale_inv'"):
        load_spec(directory)


def test_a_scale_grid_that_disagrees_with_the_block_size_names_both_shapes(tiny_deepseek_v3_fp8, tmp_path) -> None:
    def edit(tensors):
        tensors[fp8.scale_name(EXPERT)] = torch.ones(3, 2)

    directory = _rewritten(tiny_deepseek_v3_fp8[0], tmp_path, edit)
    with pytest.raises(UsageError) as info:
        load_spec(directory)
    assert all(s in str(info.value) for s in ("has shape [3, 2]", f"{EXPERT}' [32, 32]", "blocks of [16, 16]",
                                              "'quantization_config.weight_block_size'", "needs [2, 2]"))


def test_fp8_tensors_without_a_quantization_config_are_named(tiny_deepseek_v3_fp8, tmp_path) -> None:
    directory = _rewritten(tiny_deepseek_v3_fp8[0], tmp_path, lambda t: None)
    config = _config(directory)
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"stored as F8_E4M3, but config\.json has no FP8 'quantization_config'"):
        load_spec(directory)
