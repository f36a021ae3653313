"""Whole decode steps of an FP8 checkpoint on the engine: FP8 tiles resident against the dequantized fp32 tiles alone.

A Qwen3-MoE-shaped checkpoint (hidden 1,024, 64 experts of FFN 384, top-8, 2 layers: 302 MiB of fp32 experts per
layer, far beyond the CPU's caches) written by `transformers`, quantized as the FP8 releases are (blocks of
[128, 128]); `serve-bench`'s engine on 1 attention and 1 expert worker (one core each), 8 sequences, so a decode
step gives most experts one row each. Both sides are the same checkpoint and layout, the FP8 tiles switched off by
`MBRIDGE_EPOVERLAP_QUANTIZED_TILES=0` on the other; runs alternate (A B, B A), medians of the runs' decode step
times and their resident bytes as the workers report them (`mbridge_epoverlap.memory`). The tokens must be equal.

    python benchmarks/fp8_decode_step.py           # 5 runs a side, 48 new tokens
    python benchmarks/fp8_decode_step.py --quick   # 3 runs a side, 24 new tokens

Measured on an AMD EPYC (Zen 4; avx2 f16c fma avx512f avx512_bf16), 5 runs a side: decode step 27.9 ms with FP8
tiles against 30.9 ms without (1.11x), tokens equal; 153 MiB of FP8 tiles beside 1,833 MiB of fp32 weights (the
originals, oneDNN's copies, fp32 tiles). The expert stage alone (64 one-row experts, in-process) runs 10.1 against
11.3 ms: the FP8 tiles read a quarter of the bytes but convert each code (zero-extend, two shifts, a mask, F16C,
the scale's multiply) before the multiply and add the fp32 tiles also do, kept unfused for their bits: ~7 vector
operations per 8 weights against 3, which holds one core at ~7.5 G weights/s, about the rate fp32 tiles stream
from memory (25.6 GB/s). `benchmarks/fp8_tiles.py` has the wider experts ([2,048 -> 1,536]) where FP8 gains 1.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.machine import cpu_flags, cpu_model  # noqa: E402

HIDDEN, FFN, EXPERTS, TOP_K, LAYERS, BLOCK = 1024, 384, 64, 8, 2, (128, 128)
SWITCH = "MBRIDGE_EPOVERLAP_QUANTIZED_TILES"


def write_checkpoint(directory: Path) -> Path:
    """The FP8 checkpoint, from a random `Qwen3MoeForCausalLM` of the shape above."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mbridge_epoverlap.serving.model.architectures.formats.fp8 import quantize_checkpoint

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                            moe_intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=128, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            norm_topk_prob=True, max_position_embeddings=512, eos_token_id=None)
    source = directory / "float"
    Qwen3MoeForCausalLM(config).eval().save_pretrained(source)
    quantized = directory / "fp8"
    quantize_checkpoint(source, quantized, block=BLOCK, max_shard_bytes=256 << 20)
    return quantized


def run_side(checkpoint: Path, fp8_tiles: bool, new_tokens: int) -> dict:
    """One engine run; its decode step (ms, median of its steps' TBT), tokens, resident bytes by kind."""
    from mbridge_epoverlap.serving.engine.bench import synthetic_requests
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    os.environ[SWITCH] = "1" if fp8_tiles else "0"  # the workers inherit it
    spec = load_spec(checkpoint)
    result = run_engine(make_plan(spec, synthetic_requests(8, spec.vocab_size), max_new_tokens=new_tokens,
                                  max_batch=8, micro_batches=1, threads=1))
    return {"step_ms": result["tbt_ms_p50"], "tokens": [c["output_ids"] for c in result["completions"]],
            "weights": result["memory"]["weights"], "peak_rss": result["memory"]["peak_rss"]}


def measure(runs: int, new_tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="mbe-fp8-step-") as tmp:
        print("writing the FP8 checkpoint ...", file=sys.stderr, flush=True)
        checkpoint = write_checkpoint(Path(tmp))
        sides: dict[str, list[dict]] = {"fp8": [], "fp32": []}
        order = (("fp8", True), ("fp32", False))
        for i in range(runs):  # A B, then B A
            for name, on in order if i % 2 == 0 else order[::-1]:
                sides[name].append(run_side(checkpoint, on, new_tokens))
                print(f"  run {i + 1}/{runs} {name}: {sides[name][-1]['step_ms']:.1f} ms a step", file=sys.stderr,
                      flush=True)
    os.environ.pop(SWITCH, None)
    step = {name: statistics.median(r["step_ms"] for r in done) for name, done in sides.items()}
    flags = " ".join(f for f in ("avx2", "f16c", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in cpu_flags())
    return {"cpu": cpu_model(), "flags": flags, "hidden": HIDDEN, "ffn": FFN, "experts": EXPERTS, "top_k": TOP_K,
            "layers": LAYERS, "batch": 8, "runs": runs, "new_tokens": new_tokens,
            "step_ms": {k: round(v, 2) for k, v in step.items()}, "speedup": round(step["fp32"] / step["fp8"], 3),
            "tokens_equal": all(r["tokens"] == sides["fp8"][0]["tokens"] for done in sides.values() for r in done),
            "weights": {name: done[0]["weights"] for name, done in sides.items()},
            "peak_rss": {name: max(r["peak_rss"] for r in done) for name, done in sides.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs a side, alternated (medians)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="3 runs a side, 24 new tokens")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.runs < 1 or args.new_tokens < 2:
        parser.error("--runs must be positive and --new-tokens at least 2")
    doc = measure(3 if args.quick else args.runs, 24 if args.quick else args.new_tokens)
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    mib = {name: {k: v / 2**20 for k, v in w.items() if v} for name, w in doc["weights"].items()}
    print(f"{doc['cpu']} ({doc['flags']}); {doc['layers']} layers of {doc['experts']} experts [{HIDDEN} -> "
          f"{2 * FFN}], top-{TOP_K}, batch {doc['batch']}, 1 attention + 1 expert worker")
    for name in ("fp8", "fp32"):
        held = ", ".join(f"{v:,.1f} MiB {k}" for k, v in mib[name].items())
        print(f"  {name} tiles: decode step {doc['step_ms'][name]:.2f} ms; weights {held}; peak RSS "
              f"{doc['peak_rss'][name] / 2**20:,.0f} MiB")
    print(f"  FP8 tiles {doc['speedup']:.2f}x the fp32 step; tokens equal: {doc['tokens_equal']}")


if __name__ == "__main__":
    main()
