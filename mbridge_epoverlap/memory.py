"""What a serving worker holds in memory: its weights' resident bytes by kind, its KV cache's, its M2N buffers', and
the process's resident set (before the weights, now, at its peak).

The weights are every tensor reachable from the worker's model parts (`AttentionPart`, `ExpertPart`: originals,
oneDNN's packed copies, the tiles of `small_gemm`), each storage counted once however many views share it; the
KV cache every tensor of its `KVCache`; the buffers every tensor of its M2N communicators (slots in shared memory,
mapped from each peer too, as the process's resident set counts them). A holder's class says which it is
(`memory_role`). A tensor's kind is its dtype (`fp32`, `bf16`), or the format it stands for
where its holder says so (`memory_kind`: FP8 tiles' codes and their scales are `fp8`). GPT-OSS's MXFP4 experts
are dequantized as they load, so `mxfp4` is 0 unless a part keeps them so. The process's resident set is read
from `/proc/self/status` (Linux; absent elsewhere). Only the walk imports torch: the front end sums and prints the
workers' records without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

KINDS = ("fp32", "bf16", "fp8", "mxfp4")  # the kinds a report always names, 0 where none is held
WEIGHTS = "weights"
KV_CACHE = "kv_cache"
BUFFERS = "buffers"

_DTYPE_KINDS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8",
                "float8_e5m2": "fp8"}
_STATUS_FIELDS = {"VmRSS": "rss", "VmHWM": "peak_rss"}  # /proc/<pid>/status, in kB


def resident_bytes(root: Any) -> dict[str, Any]:
    """The weights' bytes by kind (`KINDS` always present, others such as `int64` where held), the KV cache's bytes
    and the communication buffers' (the M2N channels' slots, shared memory mapped from each peer included) of every
    part, cache and communicator reachable from `root` (a worker, or a part itself)."""
    out: dict[str, Any] = {WEIGHTS: dict.fromkeys(KINDS, 0), KV_CACHE: 0, BUFFERS: 0}
    for role, kind, nbytes in _tensors(root):
        if role == WEIGHTS:
            out[WEIGHTS][kind] = out[WEIGHTS].get(kind, 0) + nbytes
        else:
            out[role] += nbytes
    return out


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """`rss` (resident now) and `peak_rss` (its high-water mark) of a process in bytes; {} where unreadable (not
    Linux, the process gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in _STATUS_FIELDS:
            out[_STATUS_FIELDS[name]] = int(value.split()[0]) * 1024
    return out


def _tensors(root: Any) -> Iterator[tuple[str, str, int]]:
    """(role, kind, bytes) of every distinct storage under `root`'s parts and caches. Walks the project's own
    objects and the containers and modules they hold; a holder's `memory_role` (weights, KV cache) and
    `memory_kind` apply to everything below it."""
    import torch

    seen_objects: set[int] = set()
    seen_storages: set[tuple[int, int]] = set()
    stack: list[tuple[Any, str | None, str | None]] = [(root, None, None)]
    while stack:
        obj, role, kind = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if role is not None:
                key, nbytes = _storage(obj)
                if key not in seen_storages:
                    seen_storages.add(key)
                    dtype = str(obj.dtype).removeprefix("torch.")
                    yield role, kind or _DTYPE_KINDS.get(dtype, dtype), nbytes
            continue
        role = getattr(type(obj), "memory_role", None) or role
        kind = getattr(type(obj), "memory_kind", None) or kind
        stack.extend((child, role, kind) for child in _children(obj))


def _children(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [item for item in obj if not isinstance(item, (int, float, str, bool))]
    if isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith("mbridge_epoverlap."):
        values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
        return values + [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
    return []


def _storage(tensor: Any) -> tuple[tuple[int, int], int]:
    """A key for the memory a tensor's data lives in, and that memory's bytes. oneDNN's packed weights are opaque
    (no storage to ask): their element count times the element size, keyed by the tensor itself."""
    if tensor.is_mkldnn:
        return (0, id(tensor)), tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    return (1, storage.data_ptr()), storage.nbytes()


def total(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Every process's record (`rank`, `weights`, `kv_cache`, `buffers`, `runtime`, `rss`, `peak_rss`) summed: the
    weights by kind, the KV cache, the buffers, the runtime, the resident sets, and `peak_over_held`, the summed
    peaks over what the processes are known to hold (weights, KV cache, buffers and runtime)."""
    weights: dict[str, int] = dict.fromkeys(KINDS, 0)
    for record in records:
        for kind, nbytes in record[WEIGHTS].items():
            weights[kind] = weights.get(kind, 0) + nbytes
    sums = {key: sum(r.get(key, 0) for r in records) for key in (KV_CACHE, BUFFERS, "runtime", "rss", "peak_rss")}
    held = sum(weights.values()) + sums[KV_CACHE] + sums[BUFFERS] + sums["runtime"]
    return {WEIGHTS: weights, **sums, "peak_over_held": sums["peak_rss"] / held if held else None,
            "processes": records}


def describe(summary: dict[str, Any]) -> str:
    """A `total` in words: "weights 81.0 MiB fp32 + 20.3 MiB fp8, KV cache 4.0 MiB, buffers 6.1 MiB, runtime
    930.2 MiB; peak RSS 1.1 GiB (1.02x)"."""
    weights = summary[WEIGHTS]
    held = [f"{_size(weights[kind])} {kind}" for kind in KINDS if weights.get(kind)]
    other = sum(n for kind, n in weights.items() if kind not in KINDS)
    if other * 100 > sum(weights.values()):  # index tables and the like: named where they weigh
        held.append(f"{_size(other)} other")
    held = held or ["0 B"]
    line = (f"weights {' + '.join(held)}, KV cache {_size(summary[KV_CACHE])}, buffers {_size(summary[BUFFERS])}, "
            f"runtime {_size(summary['runtime'])}")
    if summary["peak_rss"]:
        line += f"; peak RSS {_size(summary['peak_rss'])} ({summary['peak_over_held']:.2f}x)"
    return line


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
