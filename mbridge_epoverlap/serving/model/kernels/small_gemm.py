"""fp32 GEMMs of one to a few rows on weights tiled for streaming (`small_gemm.c`), for a decode step's experts.

At a decode step most experts get one to a few rows (64 experts top-8 at 8-16 sequences: 1-2 rows each), and
each oneDNN call costs ~10 us before any arithmetic: two calls per expert, ~40-60 experts a layer. One call here
runs every small expert of a layer, each tile of its weight read once, front to back. Measured on an AMD EPYC
(Zen 4, one thread, weights out of cache): [256 -> 512] at 1 row 21-27 against 33-45 us, [512 -> 512] 35-55
against 46-64 us; at 4 rows a GEMM alone is level, at 8 oneDNN is faster (it computes near the core's peak).
Whole decode steps, alternated (`PackedExperts` sending experts of up to `SMALL_ROWS` = 4 rows here; 16 on a CPU
without AVX-512, where oneDNN's kernels are half as wide: `_small_rows`): the 108M
Qwen3-MoE (64 experts of [512 -> 512] and [256 -> 512]) at 8 sequences 0.72-0.73x the step's time, at 16
0.75-0.76x, at 32 0.92x; the 57M Mixtral (8 experts of [512 -> 2,048] and [1,024 -> 512]) at 16 sequences 0.95x.
Up to 2 rows: the Qwen3-MoE 0.71x at 4 sequences, 0.78-0.81x at 8, 0.83-0.85x at 16, 0.93-0.97x at 32, 0.97x at
64; the Mixtral 0.95x at 4, 0.87x at 8, 0.98x at 16, 1.02x at 64. Up to 6-8 rows the Mixtral lost (1.02-1.05x at
16-32).

A call can share its units (one expert's one tile of 32 outputs) among threads (`set_threads`: the caller and
helper threads of the library's own, which take units from an atomic counter and sleep between calls after
`SPIN_US`), which a worker process with several cores does at its narrow steps (`workers.step_cores`); there an
expert of up to `SPLIT_ROWS` rows runs here. Reading the weights with both cores of a 2-core AMD EPYC: 64 experts
of [512 -> 512] at one row 2.2-2.3 against 2.0-2.2 ms a call back to back (the memory's limit), 1.95 against
3.0 ms a call with a millisecond of other work between calls; the Qwen3-MoE's decode steps at 16 sequences
14.7-16.5 against 20.0-22.5 ms, at 48 35 against 50-60 ms.

Every output is one chain of multiplies and adds in k order, compiled without fused multiply-adds: the bits
are the same on every CPU, at any thread count and for a row whatever rows it is multiplied with
(`reference_tiled_gemm` is the same arithmetic in torch, the tests' check). The shared library is compiled at first
use with the system's C compiler (`$CC`, else `cc`) for this CPU and cached under
`$XDG_CACHE_HOME/mbridge-epoverlap/native`; where no compiler builds it, or `MBRIDGE_EPOVERLAP_SMALL_GEMM=0`,
`available()` is False and every expert runs on oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.kernels import build

SOURCE = Path(__file__).with_name("small_gemm.c")
TILE = 32  # outputs per tile, as small_gemm.c's TILE
SMALL_ROWS_ENV = "MBRIDGE_EPOVERLAP_SMALL_GEMM_ROWS"


def _small_rows() -> int:
    """An expert with this many rows or fewer runs here, on one thread: `MBRIDGE_EPOVERLAP_SMALL_GEMM_ROWS`, else by
    the widest vectors the CPU has. With AVX-512, oneDNN's fp32 GEMMs near the core's peak win from 6-8 rows (the
    docstring's step timings: 4). With AVX2 only, oneDNN's 8-wide kernels lose to the tiles well past that: decode
    steps of 64 sequences, one thread, AMD EPYC AVX2-only, alternated, medians of 3, experts' stage at 4 / 16 / 32
    rows: 108M Qwen3-MoE 75.7 / 45.6 / 47.0 ms (step 102 / 74 / 75), Nemotron-H 48.0 / 30.8 / 27.9, 57M Mixtral
    39.7 / 36.6 / 34.7: 16."""
    override = os.environ.get(SMALL_ROWS_ENV)
    if override is not None:
        if not override.isdigit():
            raise UsageError(f"{SMALL_ROWS_ENV}={override!r}: expected a whole number of rows (0: oneDNN only)")
        return int(override)
    from mbridge_epoverlap.machine import cpu_flags

    return 4 if "avx512f" in cpu_flags() else 16


SMALL_ROWS = _small_rows()
# ... or this many, where the calls have several threads (`set_threads`): every GEMM of a narrow step, which has
# fewer tokens (`workers.step_cores.WIDE_TOKENS`). Up to 64 before; at 128 a step of 12 decoding sequences and a
# 64-token prompt, one process on 2 cores (AMD EPYC, AVX2 only, alternated, medians of 20): Mixtral 44.5 -> 40.7
# ms, Qwen3-MoE 52.0 -> 50.4; with 40 sequences the Mixtral 57.0 -> 51.9
SPLIT_ROWS = 128
# How long a helper thread waits spinning for the next call before it sleeps (`MBRIDGE_EPOVERLAP_SMALL_GEMM_SPIN_US`)
SPIN_US = int(os.environ.get("MBRIDGE_EPOVERLAP_SMALL_GEMM_SPIN_US", "300"))
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_errors: list[str] = []
_threads = 1


def enabled() -> bool:
    """`MBRIDGE_EPOVERLAP_SMALL_GEMM` is not 0."""
    return os.environ.get("MBRIDGE_EPOVERLAP_SMALL_GEMM", "1") != "0"


def available() -> bool:
    """Whether the tiled GEMMs run here: enabled, and the library built and loaded."""
    return enabled() and _library() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None where it is True)."""
    if not enabled():
        return "MBRIDGE_EPOVERLAP_SMALL_GEMM=0"
    return build.last_error(_errors) if _library() is None else None


def set_threads(threads: int) -> int:
    """Threads every later call shares its experts' tiles among (the caller and `threads - 1` helpers, started
    once); returns the number in use (1 where the library does not run here)."""
    global _threads
    lib = _library()
    _threads = 1 if lib is None else int(lib.small_gemm_set_threads(max(1, threads), SPIN_US))
    return _threads


def threads() -> int:
    """Threads a call uses now (`set_threads`)."""
    return _threads


def fits(out_features: int) -> bool:
    """Whether a weight with `out_features` rows tiles (whole tiles only)."""
    return out_features % TILE == 0


def runs_for(dtype: torch.dtype, *out_features: int) -> bool:
    """Whether weights of `dtype` with these row counts run on the tiled GEMMs here: fp32, whole tiles, the library
    built and loaded."""
    return dtype == torch.float32 and all(fits(n) for n in out_features) and available()


def tiled(weight: torch.Tensor) -> torch.Tensor:
    """weight [O, K] fp32 -> its tiles [O / TILE, K, TILE] (a copy; O a multiple of TILE)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.float32 or not fits(out_features):
        raise ValueError(f"a tiled weight is fp32 with a multiple of {TILE} rows, got {weight.dtype} "
                         f"[{out_features}, {in_features}]")
    return weight.detach().view(out_features // TILE, TILE, in_features).transpose(1, 2).contiguous()


class Fp8Tiles(NamedTuple):
    """A weight's tiles held as FP8 (`tiled_fp8`): e4m3 codes [O / TILE, K, TILE] and the scale of each output for
    each block of `block_cols` columns, [O / TILE, ceil(K / block_cols), TILE] (times 256, as the kernel takes it)."""

    codes: torch.Tensor
    scales: torch.Tensor
    block_cols: int
    # Codes and scales both count as FP8 weights (`memory.resident_bytes`); not annotated: a NamedTuple's
    # annotated names are its fields.
    memory_kind = "fp8"

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4


def tiled_fp8(weight: torch.Tensor, row_scales: torch.Tensor, block_cols: int) -> Fp8Tiles | None:
    """The tiles of an fp32 weight [O, K] that an FP8 checkpoint dequantized to, held as its FP8 codes and scales:
    `row_scales` [O, ceil(K / block_cols)] is each output row's scale per block of columns. None where a weight is
    not exactly code times scale (the codes would not give back its bits): the caller keeps fp32 tiles."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.float32 or not fits(out_features):
        raise ValueError(f"a tiled weight is fp32 with a multiple of {TILE} rows, got {weight.dtype} "
                         f"[{out_features}, {in_features}]")
    scales = row_scales.float().repeat_interleave(block_cols, dim=1)[:, :in_features]
    if not bool((scales > 0).all()):
        return None
    codes = (weight / scales).to(torch.float8_e4m3fn)
    if not torch.equal(codes.float() * scales, weight):
        return None
    code_tiles = codes.view(torch.uint8).view(out_features // TILE, TILE, in_features).transpose(1, 2).contiguous()
    scale_tiles = (row_scales.float() * 256.0).view(out_features // TILE, TILE, -1).transpose(1, 2).contiguous()
    return Fp8Tiles(code_tiles, scale_tiles, block_cols)


def grouped(x: torch.Tensor, groups: Sequence[tuple[int, int]], weights: Sequence[torch.Tensor | Fp8Tiles],
            out: torch.Tensor) -> None:
    """For each group (start, count) and its tiled weight: out[start:start+count] = x[start:start+count] @ W.T.

    x [rows, K] and out [rows, O] fp32, contiguous; `weights[g]` [O / TILE, K, TILE] (`tiled`), or `Fp8Tiles`
    (`tiled_fp8`: the same bits from a quarter of the bytes). One call per kind of tile."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the tiled GEMMs do not run here: {unavailable_reason()}")
    if not groups:
        return
    if not (x.dtype == out.dtype == torch.float32 and x.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"the tiled GEMMs take contiguous fp32 rows, got x {x.dtype} "
                         f"{'contiguous' if x.is_contiguous() else 'strided'}, out {out.dtype} "
                         f"{'contiguous' if out.is_contiguous() else 'strided'}")
    if any(isinstance(w, Fp8Tiles) for w in weights):
        fp8 = [(g, w) for g, w in zip(groups, weights, strict=True) if isinstance(w, Fp8Tiles)]
        _grouped_fp8(x, [g for g, _ in fp8], [w for _, w in fp8], out)
        rest = [(g, w) for g, w in zip(groups, weights, strict=True) if not isinstance(w, Fp8Tiles)]
        if not rest:
            return
        groups, weights = [g for g, _ in rest], [w for _, w in rest]
    n = len(groups)
    starts = (_I64 * n)(*(start for start, _ in groups))
    counts = (_I64 * n)(*(count for _, count in groups))
    addresses = (_I64 * n)(*(w.data_ptr() for w in weights))
    lib.small_gemm_groups(x.data_ptr(), x.shape[1], x.shape[1], starts, counts, addresses, n, out.shape[1],
                          out.data_ptr(), out.shape[1])


def _grouped_fp8(x: torch.Tensor, groups: Sequence[tuple[int, int]], weights: Sequence[Fp8Tiles],
                 out: torch.Tensor) -> None:
    """`grouped` on FP8 tiles, one call per block width (a checkpoint has one)."""
    lib = _library()
    for block in sorted({w.block_cols for w in weights}):
        chosen = [i for i, w in enumerate(weights) if w.block_cols == block]
        n = len(chosen)
        starts = (_I64 * n)(*(groups[i][0] for i in chosen))
        counts = (_I64 * n)(*(groups[i][1] for i in chosen))
        addresses = (_I64 * n)(*(weights[i].codes.data_ptr() for i in chosen))
        scales = (_I64 * n)(*(weights[i].scales.data_ptr() for i in chosen))
        lib.small_gemm_groups_fp8(x.data_ptr(), x.shape[1], x.shape[1], starts, counts, addresses, scales, block, n,
                                  out.shape[1], out.data_ptr(), out.shape[1])


def reference_tiled_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ weight[O, K].T as `small_gemm.c` computes it, in torch: per output, a product then a sum, k in
    order from zero (fp32 multiplies and adds round the same in both). Slow: for tests."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = acc + x[:, k:k + 1] * weight[:, k][None, :]
    return acc


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled library (`build.load`), or None with the reason in `_errors`."""
    global _threads
    _threads = 1  # a library loaded now starts with no helper threads
    lib = build.load(SOURCE, _errors)
    if lib is None:
        return None
    lib.small_gemm_tile.restype = ctypes.c_int
    if lib.small_gemm_tile() != TILE:
        _errors.append(f"{SOURCE.stem} tiles by {lib.small_gemm_tile()}, expected {TILE}")
        return None
    lib.small_gemm_set_threads.restype = _I64
    lib.small_gemm_set_threads.argtypes = [_I64, _I64]
    lib.small_gemm_groups_fp8.restype = None
    lib.small_gemm_groups_fp8.argtypes = [_PTR, _I64, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64),
                                          ctypes.POINTER(_I64), ctypes.POINTER(_I64), _I64, _I64, _I64, _PTR, _I64]
    lib.small_gemm_groups.restype = None
    lib.small_gemm_groups.argtypes = [_PTR, _I64, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64),
                                      ctypes.POINTER(_I64), _I64, _I64, _PTR, _I64]
    return lib
