"""A decode step's expert stage of an FP8 checkpoint: FP8 tiles against the dequantized fp32 tiles, side by side.

One MoE layer's experts at DeepSeek-V3-like widths shrunk for a CPU (hidden 2,048, expert FFN 768, blocks of
[128, 128]), far larger than the CPU's caches, quantized as the FP8 releases are; `PackedExperts.swiglu` (up GEMM,
SwiGLU, down GEMM) on 1, 2 and 4 rows per expert, as a decode step gives them, reading the FP8 tiles (whatever the
default row limit, `packed.FP8_ROWS`) and the fp32 tiles of the same layer, alternated (A B, B A), medians. The
outputs must be bitwise equal. One torch thread, as a worker process computes, with the tiled calls on one thread
and on every core (`small_gemm.set_threads`, as a worker's narrow decode steps run them).

    python benchmarks/fp8_tiles.py                 # 32 experts, 9 alternations
    python benchmarks/fp8_tiles.py --quick --json  # 12 experts, 5 alternations
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.machine import cpu_flags, cpu_model  # noqa: E402

HIDDEN, FFN, BLOCK = 2048, 768, (128, 128)


def _layer(experts: int):
    """(PackedExperts holding both FP8 and fp32 tiles of the same weights, tile bytes by kind)."""
    import torch

    from mbridge_epoverlap.serving.model import packed
    from mbridge_epoverlap.serving.model.architectures.formats import fp8

    gen = torch.Generator().manual_seed(0)
    w1 = torch.empty(experts, 2 * FFN, HIDDEN)
    w2 = torch.empty(experts, HIDDEN, FFN)
    s1 = torch.empty(experts, 2 * FFN, -(-HIDDEN // BLOCK[1]))
    s2 = torch.empty(experts, HIDDEN, -(-FFN // BLOCK[1]))
    for e in range(experts):
        for weight, row_scales, width in ((w1, s1, HIDDEN), (w2, s2, FFN)):
            q, s = fp8.quantize(torch.randn(weight.shape[1], width, generator=gen) * width ** -0.5, BLOCK)
            weight[e] = fp8.dequantize(q, s, BLOCK)
            row_scales[e] = s.index_select(0, torch.arange(weight.shape[1]) // BLOCK[0])
    layer = packed.PackedExperts(w1, w2, packed.Fp8RowScales(s1, s2, BLOCK[1]))
    tiles = [layer.packed_of(e) for e in range(experts)]
    if any(t.up_fp8 is None for t in tiles):
        raise SystemExit("the FP8 tiles were not built (is the tiled GEMM library built here?)")
    fp8_bytes = sum(t.up_fp8.nbytes + t.down_fp8.nbytes for t in tiles)
    fp32_bytes = sum(t.up_tiles.numel() * 4 + t.down_tiles.numel() * 4 for t in tiles)
    return layer, {"fp32_tiles": fp32_bytes, "fp8_tiles": fp8_bytes}


def _fp8_up_to(rows: int) -> None:
    """Experts of up to `rows` rows read their FP8 tiles, on any thread count (0: none does)."""
    from mbridge_epoverlap.serving.model import packed

    packed.FP8_ROWS = packed.FP8_SPLIT_ROWS = rows


def measure(experts: int, rounds: int) -> dict:
    """Each side on the same `PackedExperts` (the same fp32 tiles and oneDNN copies in memory, so only the tiles a
    few-row expert reads differ): FP8 forced for the measured row count, against none."""
    import os

    import torch

    from mbridge_epoverlap.serving.model import packed
    from mbridge_epoverlap.serving.model.kernels import small_gemm

    torch.set_num_threads(1)
    layer, nbytes = _layer(experts)
    default = (packed.FP8_ROWS, packed.FP8_SPLIT_ROWS)
    rows_out = []
    cores = len(os.sched_getaffinity(0))
    try:
        for threads, rows in [(1, r) for r in (1, 2, 4)] + ([(cores, r) for r in (1, 2, 4)] if cores > 1 else []):
            small_gemm.set_threads(threads)
            counts = [rows] * experts
            x = torch.randn(rows * experts, HIDDEN, generator=torch.Generator().manual_seed(rows))
            sides = (("fp8", rows), ("fp32", 0))
            outputs = {}
            for name, limit in sides:
                _fp8_up_to(limit)
                outputs[name] = layer.swiglu(x, counts)
            times: dict[str, list[float]] = {"fp8": [], "fp32": []}
            for i in range(rounds):  # A B, then B A: neither side always runs first
                for name, limit in sides if i % 2 == 0 else sides[::-1]:
                    _fp8_up_to(limit)
                    start = time.perf_counter()
                    layer.swiglu(x, counts)
                    times[name].append(time.perf_counter() - start)
            fp8_ms, fp32_ms = (statistics.median(times[k]) * 1e3 for k in ("fp8", "fp32"))
            rows_out.append({"threads": threads, "rows_per_expert": rows, "fp8_ms": round(fp8_ms, 3),
                             "fp32_ms": round(fp32_ms, 3), "speedup": round(fp32_ms / fp8_ms, 3),
                             "bitwise_equal": torch.equal(outputs["fp8"], outputs["fp32"])})
    finally:
        packed.FP8_ROWS, packed.FP8_SPLIT_ROWS = default
        small_gemm.set_threads(1)
    flags = " ".join(f for f in ("avx2", "f16c", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in cpu_flags())
    return {"cpu": cpu_model(), "flags": flags, "experts": experts, "hidden": HIDDEN, "ffn": FFN,
            "block": list(BLOCK), "rounds": rounds, "bytes": nbytes, "rows": rows_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9, help="A B alternations (medians)")
    parser.add_argument("--quick", action="store_true", help="12 experts, 5 alternations")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.experts < 1 or args.rounds < 1:
        parser.error("--experts and --rounds must be positive")
    doc = measure(12 if args.quick else args.experts, 5 if args.quick else args.rounds)
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{doc['cpu']} ({doc['flags']}); {doc['experts']} experts [{HIDDEN} -> {2 * FFN}], [{FFN} -> {HIDDEN}], "
          f"blocks {BLOCK}")
    mib = {k: v / 2**20 for k, v in doc["bytes"].items()}
    print(f"tile bytes: fp32 {mib['fp32_tiles']:,.1f} MiB, FP8 {mib['fp8_tiles']:,.1f} MiB (codes and scales)")
    for row in doc["rows"]:
        print(f"  {row['threads']} thread(s), {row['rows_per_expert']} rows/expert: FP8 {row['fp8_ms']:.2f} ms, "
              f"fp32 {row['fp32_ms']:.2f} ms, {row['speedup']:.2f}x, bitwise equal {row['bitwise_equal']}")


if __name__ == "__main__":
    main()
