"""A MoE layer's combine in one pass (`combine.c`): each token's expert outputs times its gates, summed in
ascending expert id, plus its residual: the bits of `parts.gate_weighted_sum` then the residual's add.

The torch loop gathers the [T, k, hidden] rows into expert order (one copy of them all) and runs 2k elementwise
passes. Here each output row is built in cache from its k rows, one call a layer. Measured on an AMD EPYC (Zen
4, avx512f avx512_bf16, one thread), 64 experts top-8, hidden 512: 1,024 tokens 3.4-3.6 ms -> 1.15 ms, 16 tokens
(a decode step) 72-75 -> 8-17 us; in a warm 16 x 64-token Qwen3-MoE prefill the combine's 19-54 ms -> 4-5 ms.

fp32 only (a bf16 model's products round to bf16 between steps, which the loop does and this does not); where
the library does not build, `available()` is False and the loop runs.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from mbridge_epoverlap.serving.model.kernels import build

SOURCE = Path(__file__).with_name("combine.c")
MAX_K = 64  # as combine.c's MAX_K
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_errors: list[str] = []


def available() -> bool:
    """Whether the one-pass combine runs here (the library built and loaded)."""
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None where it is True)."""
    return build.last_error(_errors) if _library() is None else None


def applies(expert_out: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor, resid: torch.Tensor) -> bool:
    """Whether `weighted_sum` takes these: fp32 rows [T, k, hidden] with contiguous rows, fp32 gates and residual,
    k <= MAX_K, and the library here."""
    return (expert_out.dtype == gates.dtype == resid.dtype == torch.float32 and expert_out.dim() == 3
            and expert_out.stride(2) == 1 and expert_ids.shape[1] <= MAX_K and available())


def weighted_sum(expert_out: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor,
                 resid: torch.Tensor | None) -> torch.Tensor:
    """[T, hidden]: per token, 0 + out[t, j] * gates[t, j] for j in ascending `expert_ids[t]`, then resid + that.

    expert_out [T, k, hidden] fp32 (any token and slot strides, rows contiguous); expert_ids [T, k] int64 (distinct
    per token); gates [T, k] fp32; resid [T, hidden] fp32 or None (the sum alone)."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the one-pass combine does not run here: {unavailable_reason()}")
    if expert_out.dtype != torch.float32 or gates.dtype != torch.float32 or expert_out.stride(2) != 1:
        raise ValueError(f"the one-pass combine takes fp32 expert outputs with contiguous rows and fp32 gates, got "
                         f"{expert_out.dtype} (row stride {expert_out.stride(2)}) and {gates.dtype} gates")
    tokens, k, hidden = expert_out.shape
    if expert_ids.shape != (tokens, k) or gates.shape != (tokens, k):
        raise ValueError(f"expert ids {list(expert_ids.shape)} and gates {list(gates.shape)} must be [{tokens}, {k}]")
    ids = expert_ids.to(torch.int64).contiguous()
    gates = gates.contiguous()
    if resid is not None:
        resid = resid.contiguous()
        if resid.dtype != torch.float32 or resid.shape != (tokens, hidden):
            raise ValueError(f"resid must be fp32 [{tokens}, {hidden}], got {resid.dtype} {list(resid.shape)}")
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    if tokens:
        status = lib.combine_rows(expert_out.data_ptr(), expert_out.stride(0), expert_out.stride(1), ids.data_ptr(),
                                  gates.data_ptr(), tokens, k, hidden, 0 if resid is None else resid.data_ptr(),
                                  out.data_ptr())
        if status != 0:
            raise ValueError(f"the one-pass combine takes at most {MAX_K} experts per token, got {k}")
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled library (`build.load`), or None with the reason in `_errors`."""
    lib = build.load(SOURCE, _errors)
    if lib is None:
        return None
    lib.combine_rows.restype = ctypes.c_int
    lib.combine_rows.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR]
    return lib
