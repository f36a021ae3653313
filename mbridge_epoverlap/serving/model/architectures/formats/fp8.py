"""FP8 block-scaled weights (DeepSeek-V3/R1/V3.1, Kimi K2, the `-FP8` releases of Qwen3 and GLM-4.5), dequantized
when a tensor is read.

`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [b0, b1]}: a quantized linear weight `W` [out, in] is stored as `float8_e4m3fn` beside
`W_scale_inv` (fp32) [ceil(out / b0), ceil(in / b1)], and its value is `W_fp8.float() * scale_inv[i // b0, j // b1]`
(a last partial block takes the scale of its block). Embeddings, norms, routers and the head stay unquantized: a
tensor is quantized exactly where the checkpoint stores it as F8_E4M3 with a scale beside it, which covers
`modules_to_not_convert` without reading it. Dequantized in fp32, then converted to the model's dtype.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbridge_epoverlap.errors import UsageError

if TYPE_CHECKING:
    import torch

METHOD = "fp8"
STORED_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SCALE_DTYPES = ("F32", "BF16", "F16")
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default where a config leaves the size out
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"


def scale_name(weight_name: str) -> str:
    """The scale tensor stored beside a quantized weight (`...q_proj.weight` -> `...q_proj.weight_scale_inv`)."""
    return weight_name + SCALE_SUFFIX


def read_block(path: Path, config: Any) -> tuple[int, int]:
    """`weight_block_size` of an FP8 `quantization_config`, after checking every field the engine relies on;
    a UsageError names the field and what it must be."""
    where = f"{path}: field 'quantization_config"
    if not isinstance(config, dict):
        raise UsageError(f"{where}' is {config!r}; it must be an object")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UsageError(f"{where}.fmt' is {fmt!r}; only 'e4m3' FP8 weights are supported")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UsageError(f"{where}.activation_scheme' is {scheme!r}; only 'dynamic' is supported (activations are "
                         "not quantized: the weights are dequantized)")
    block = config.get("weight_block_size", list(DEFAULT_BLOCK))
    if (not isinstance(block, list | tuple) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
        raise UsageError(f"{where}.weight_block_size' is {block!r}; it must be two positive integers [rows, columns]")
    skipped = config.get("modules_to_not_convert")
    if skipped is not None and (not isinstance(skipped, list) or not all(isinstance(m, str) for m in skipped)):
        raise UsageError(f"{where}.modules_to_not_convert' is {skipped!r}; it must be a list of module names")
    return int(block[0]), int(block[1])


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a weight [out, in]: [ceil(out / b0), ceil(in / b1)]."""
    return math.ceil(weight_shape[0] / block[0]), math.ceil(weight_shape[1] / block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *,
               first_row: int = 0) -> torch.Tensor:
    """fp32 value of stored FP8 rows: `weight` [rows, in] float8_e4m3fn, rows `first_row ..` of the whole weight, and
    `scale_inv` the scale rows covering them (from block row `first_row // b0`)."""
    import torch

    rows, cols = weight.shape
    row_block = (torch.arange(first_row, first_row + rows) // block[0]) - first_row // block[0]
    col_block = torch.arange(cols) // block[1]
    scales = scale_inv.float().index_select(0, row_block).index_select(1, col_block)
    return weight.float() * scales


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn weight, fp32 scale_inv) as the FP8 releases store them: each block's
    scale its largest magnitude over 448 (e4m3's largest). For tests and for writing FP8 checkpoints."""
    import torch

    out_rows, cols = weight.shape
    grid = scale_shape((out_rows, cols), block)
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:out_rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    quantized = (blocks / scale[:, None, :, None]).view_as(padded)[:out_rows, :cols]
    return quantized.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def is_quantized_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the FP8 releases quantize this tensor: a 2-D `*_proj.weight` (attention, MLP and expert
    projections); embeddings, norms, routers (`mlp.gate`) and the head stay as they are."""
    return len(shape) == 2 and name.endswith("_proj.weight") and ".layers." in name


def quantize_checkpoint(source: Path, target: Path, *, block: tuple[int, int] = DEFAULT_BLOCK,
                        max_shard_bytes: int | None = None) -> None:
    """Write `source` (a float checkpoint) to `target` as the FP8 releases are laid out: every projection weight
    FP8 with its `weight_scale_inv`, the config's `quantization_config` set, in shards of at most
    `max_shard_bytes` with a `model.safetensors.index.json` (one file when None). Other files are copied."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if is_quantized_linear(name, tuple(tensor.shape)):
            stored[name], stored[scale_name(name)] = quantize(tensor, block)
        else:
            stored[name] = tensor.contiguous()
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json" and path.is_file():
            shutil.copy(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": METHOD,
                                     "weight_block_size": list(block)}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in stored.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(target / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(target / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in stored.values())
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
