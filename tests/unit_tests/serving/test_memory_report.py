"""What the serving workers hold in memory (`mbridge_epoverlap.memory`): the weights' resident bytes by kind, the KV
cache's, the communication buffers', in the `serve` result and table (the ready line and `/health` of a server:
`frontend/test_online_architectures.py`), and the processes' peak resident sets against them."""

from __future__ import annotations

import json

import pytest

from mbridge_epoverlap import memory
from mbridge_epoverlap.serving.engine.bench import synthetic_requests
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kernels import small_gemm
from mbridge_epoverlap.serving.model.kv_cache import KVCache
from mbridge_epoverlap.serving.model.parts import load_attention_part, load_expert_part


def test_each_storage_counts_once_whatever_holds_views_of_it(tiny_mixtral_dir) -> None:
    """The reference part holds only its parameters: their bytes, and views of them add nothing."""
    spec = load_spec(tiny_mixtral_dir)
    part = load_expert_part(spec, range(spec.num_experts))
    own = sum(p.numel() * 4 for p in part.parameters()) + part.local_index.numel() * 8
    held = memory.resident_bytes(part)
    assert sum(held["weights"].values()) == own and held["weights"]["fp32"] == own - part.local_index.numel() * 8
    layer = next(iter(part.experts.values()))
    assert memory.resident_bytes([part, layer.w1[0], layer.w2[1:], part]) == held
    assert held["kv_cache"] == 0 and held["buffers"] == 0


def test_fp8_tiles_count_as_fp8_and_packed_copies_as_fp32(tiny_deepseek_v3_fp8) -> None:
    """An FP8 checkpoint's experts served in fp32: the FP8 tiles' codes and scales (and the row scales they are
    tiled from) are the fp8 bytes; the originals, oneDNN's packed copies and the fp32 tiles the fp32 bytes."""
    if not small_gemm.available():
        pytest.skip(f"the tiled GEMMs do not run here: {small_gemm.unavailable_reason()}")
    spec = load_spec(tiny_deepseek_v3_fp8[0])
    part = load_expert_part(spec, range(spec.num_experts), packed=True)
    experts = [layer.packed_of(e) for layer in part.packed_layers.values() for e in range(spec.num_experts)]
    tiles = sum(t.nbytes for x in experts for t in (x.up_fp8, x.down_fp8))
    row_scales = sum(s.s1.nbytes + s.s2.nbytes for s in part.fp8_scales.values())
    held = memory.resident_bytes(part)["weights"]
    assert held["fp8"] == tiles + row_scales > 0
    originals = sum(p.numel() * 4 for p in part.parameters())
    copies = sum(t.numel() * 4 for x in experts for t in (x.up, x.down, x.up_tiles, x.down_tiles))
    assert held["fp32"] == originals + copies
    assert held["bf16"] == held["mxfp4"] == 0


def test_kv_cache_bytes_follow_its_growth(tiny_qwen3_moe_dir) -> None:
    spec = load_spec(tiny_qwen3_moe_dir)
    cache = KVCache.for_engine(spec)
    start = memory.resident_bytes(cache)["kv_cache"]
    assert start == sum(t.nbytes for t in cache._keys + cache._values) > 0
    for seq in range(cache._keys[0].shape[0] + 1):  # one sequence more than it has rows: the rows double
        cache.add(seq)
    assert memory.resident_bytes(cache)["kv_cache"] == 2 * start
    part = load_attention_part(spec, packed=True)
    assert memory.resident_bytes([part, cache])["kv_cache"] == 2 * start  # the part's weights are not the cache's


def test_serve_reports_every_process_and_prints_the_sum(tiny_qwen3_moe_dir, tmp_path, capsys) -> None:
    from mbridge_epoverlap.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_ids": [5 + i, 17, 42]}) + "\n" for i in range(3)))
    base = ["serve", "--checkpoint", str(tiny_qwen3_moe_dir), "--prompts", str(prompts), "--max-new-tokens", "2",
            "--micro-batches", "2", "--expert-workers", "2"]
    assert main(base + ["--json"]) == 0
    held = json.loads(capsys.readouterr().out)["memory"]
    assert [p["rank"] for p in held["processes"]] == [0, 1, 2]
    for process in held["processes"]:
        assert process["weights"]["fp32"] > 0 and process["buffers"] > 0  # the M2N slots in shared memory
        assert process["peak_rss"] >= process["rss"] > process["runtime"] > 0
    assert held["kv_cache"] == held["processes"][0]["kv_cache"] > 0  # the attention worker's alone
    assert held["weights"]["fp32"] == sum(p["weights"]["fp32"] for p in held["processes"])
    assert main(base) == 0
    assert f"memory                  {memory.describe(held)[:30]}" in capsys.readouterr().out


# A recipe model whose weights outweigh the runtime in every process (2 processes: 195 and 430 MiB of weights
# beside ~225 MiB of runtime each); the rest of a peak is oneDNN's kernels (~0.6 MiB for each GEMM shape and row
# count met) and the busiest step's buffers, kept by the allocator for the next.
@pytest.mark.parametrize("layout", [dict(micro_batches=2), dict(colocated=2)], ids=["m2", "colocated2"])
def test_peak_resident_set_is_what_the_report_accounts_for(layout) -> None:
    spec = load_spec("mixtral_8x22b", num_layers=64)
    result = run_engine(make_plan(spec, synthetic_requests(16, spec.vocab_size), max_new_tokens=4, max_batch=16,
                                  num_layers=64, **layout))
    for process in result["memory"]["processes"]:
        held = (sum(process["weights"].values()) + process["kv_cache"] + process["buffers"] + process["runtime"])
        assert 0.85 * held <= process["peak_rss"] <= 1.15 * held, (process, held)


def test_describe_names_only_the_kinds_held() -> None:
    record = {"rank": 0, "weights": {"fp32": 3 << 20, "bf16": 0, "fp8": 1 << 20, "mxfp4": 0}, "kv_cache": 1 << 10,
              "buffers": 512, "runtime": 200 << 20, "rss": 210 << 20, "peak_rss": 216 << 20}
    summary = memory.total([record, dict(record, rank=1)])
    assert summary["weights"]["fp32"] == 6 << 20 and summary["peak_over_held"] == pytest.approx(432 / 408.0, 1e-3)
    assert memory.describe(summary) == ("weights 6.0 MiB fp32 + 2.0 MiB fp8, KV cache 2.0 KiB, buffers 1.0 KiB, "
                                        "runtime 400.0 MiB; peak RSS 432.0 MiB (1.06x)")
