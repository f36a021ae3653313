"""Which dtype the serving workers compute in (`--dtype`, default `auto`), and why.

`auto` serves a checkpoint in the dtype it was saved in, as vLLM and `transformers`' `dtype="auto"` do,
where this CPU computes that dtype natively:

- a bfloat16 checkpoint computes in bfloat16 on a CPU with native bf16 (`avx512_bf16` or `amx_bf16`), and in
  float32 elsewhere: an AVX2-only CPU emulates bf16 GEMMs about 9x slower than fp32. This is the training
  side's rule (`config.cpu_precision.choose_cpu_precision`), applied with the same words;
- a float32 (or float64) checkpoint computes in float32;
- a float16 checkpoint computes in float32: the workers compute in float32 or bfloat16 only, and float32 holds
  every float16 value exactly, where bfloat16 would drop 3 of its 10 mantissa bits;
- a recipe model (random weights, no stored dtype) computes in float32, the precision its reference runs use.

The checkpoint's dtype is `config.json`'s `dtype` (transformers 5.x) or `torch_dtype` (4.x); without one, the
dtype of most of the `*.safetensors` tensors' elements (read from their headers, no tensor data). An explicit
`--dtype float32` or `--dtype bfloat16` is taken as given (bfloat16 without native bf16 with a warning).

The CPU's flags come from `mbridge_epoverlap.machine.cpu_flags` (/proc/cpuinfo, or `MBRIDGE_EPOVERLAP_CPU_FLAGS`,
so tests and users can try either branch on any machine). Torch-free.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mbridge_epoverlap.config.cpu_precision import choose_cpu_precision
from mbridge_epoverlap.errors import UsageError

AUTO = "auto"
COMPUTE_DTYPES = ("float32", "bfloat16")  # what the workers compute in (`serving.model.spec.DTYPES`)
DTYPE_CHOICES = (AUTO, *COMPUTE_DTYPES)
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
_LONG = {short: long for long, short in _SHORT.items()}
# config.json spellings (`str(torch.dtype)` without "torch.", and a few aliases) -> the dtype's name.
_CONFIG_NAMES = {"float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
                 "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
_SAFETENSORS_NAMES = {"F32": "float32", "F64": "float64", "BF16": "bfloat16", "F16": "float16"}
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header's size


@dataclass(frozen=True)
class ServingDtype:
    """The workers' compute dtype and the reason for it (what the output, `--json` and `/health` carry).

    Attributes:
        dtype: "float32" or "bfloat16".
        reason: one sentence.
        requested: the `--dtype` given ("auto", "float32" or "bfloat16").
        checkpoint_dtype: the dtype the checkpoint was saved in ("bfloat16", "float16", "float32", "float64"),
            None for a recipe model or where it cannot be told.
        checkpoint_dtype_from: where that came from ("config.json dtype", "config.json torch_dtype",
            "safetensors tensors"), None with it.
        native_bf16: whether the CPU has `avx512_bf16` or `amx_bf16`.
        cpu_flags: the GEMM-relevant flags the choice was made with.
        warning: set when the choice will be slow (explicit bfloat16 without native bf16).
    """

    dtype: str
    reason: str
    requested: str
    checkpoint_dtype: str | None
    checkpoint_dtype_from: str | None
    native_bf16: bool
    cpu_flags: tuple[str, ...]
    warning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["cpu_flags"] = list(self.cpu_flags)
        return data

    @property
    def summary(self) -> str:
        """`dtype (reason)`, for the startup log."""
        return f"{self.dtype} ({self.reason})"


def parse_dtype(text: str) -> str:
    """`--dtype`'s value, checked: "auto", "float32" or "bfloat16".

    Raises:
        UsageError: anything else, naming what to give instead (float16 and the short names get their own word).
    """
    if text in DTYPE_CHOICES:
        return text
    if text in ("float16", "fp16", "half"):
        raise UsageError(f"--dtype {text}: the workers compute in float32 or bfloat16, not float16; give --dtype "
                         "auto (the default: a float16 checkpoint computes in float32, which holds every float16 "
                         "value exactly) or --dtype float32")
    if text in _LONG:
        raise UsageError(f"--dtype {text}: write --dtype {_LONG[text]} (choices: {', '.join(DTYPE_CHOICES)})")
    raise UsageError(f"--dtype {text}: unknown dtype; choose one of {', '.join(DTYPE_CHOICES)} (default auto: the "
                     "checkpoint's dtype where this CPU computes it natively)")


def choose_serving_dtype(requested: str, source: str | Path | None, *,
                         flags: Iterable[str] | None = None) -> ServingDtype:
    """The compute dtype for `--dtype requested` on the model `source` (a checkpoint directory or a recipe name;
    see the module docstring).

    Raises:
        UsageError: `requested` is not one of `DTYPE_CHOICES`.
    """
    requested = parse_dtype(requested)
    stored, stored_from = (None, None)
    if source is not None and Path(source).is_dir():
        stored, stored_from = checkpoint_dtype(Path(source))

    def made(dtype: str, reason: str, precision: Any) -> ServingDtype:
        return ServingDtype(dtype, reason, requested, stored, stored_from, precision.native_bf16,
                            precision.cpu_flags, precision.warning)

    words: dict[str, Any] = {"origin": "the checkpoint's", "flag": "--dtype", "spelling": _LONG}
    if requested != AUTO:
        precision = choose_cpu_precision(True, requested=_SHORT[requested], flags=flags, **words)
        return made(_LONG[precision.dtype], precision.reason, precision)
    if stored == "bfloat16":
        precision = choose_cpu_precision(True, flags=flags, **words)
        return made(_LONG[precision.dtype], precision.reason, precision)
    precision = choose_cpu_precision(False, flags=flags)  # fp32; only its flags are used
    if stored == "float16":
        reason = ("fp32 for the checkpoint's float16: the workers compute in float32 or bfloat16, and float32 "
                  "holds every float16 value exactly where bfloat16 would drop 3 of its 10 mantissa bits; "
                  "--dtype bfloat16 forces bf16")
    elif stored in ("float32", "float64"):
        reason = f"fp32: the checkpoint's dtype ({stored}, from its {stored_from})"
    elif source is not None and Path(source).is_dir():
        reason = "fp32: the checkpoint's dtype could not be told (no config.json dtype, no float tensors)"
    else:
        reason = ("fp32: a recipe model is random weights with no dtype of its own, computed in float32 as its "
                  "reference runs are; --dtype bfloat16 forces bf16")
    return made("float32", reason, precision)


def checkpoint_dtype(directory: Path) -> tuple[str | None, str | None]:
    """The dtype `directory`'s checkpoint was saved in and where that was read, or (None, None).

    `config.json`'s `dtype` (transformers 5.x) or `torch_dtype` (4.x); else the dtype of most of the float
    tensors' elements in the `*.safetensors` headers. Nothing here raises: `load_spec` reports a malformed
    checkpoint, naming the file and the field."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict):
        for field in ("dtype", "torch_dtype"):
            value = config.get(field)
            if isinstance(value, str):
                name = _CONFIG_NAMES.get(value.removeprefix("torch."))
                if name is not None:
                    return name, f"config.json {field}"
    elements: dict[str, int] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for dtype, count in _header_elements(path).items():
            elements[dtype] = elements.get(dtype, 0) + count
    if not elements:
        return None, None
    return max(elements, key=lambda name: elements[name]), "safetensors tensors"


def _header_elements(path: Path) -> dict[str, int]:
    """Float elements per dtype in one safetensors file, from its JSON header (an 8-byte little-endian length,
    then the header); {} where the file cannot be read so."""
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > _HEADER_LIMIT:
                return {}
            header = json.loads(fh.read(length))
    except (OSError, ValueError, struct.error):
        return {}
    counts: dict[str, int] = {}
    for name, entry in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        dtype = _SAFETENSORS_NAMES.get(entry.get("dtype", ""))
        shape = entry.get("shape")
        if dtype is None or not isinstance(shape, list):
            continue
        size = 1
        for dim in shape:
            size *= int(dim) if isinstance(dim, int) else 0
        counts[dtype] = counts.get(dtype, 0) + size
    return counts
