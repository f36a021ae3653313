"""Model sources for serving: a local Hugging Face checkpoint directory or a recipe name.

`load_spec` reads and checks everything before any weight is loaded: `config.json` (architecture, sizes,
the semantics flags), `generation_config.json` (end-of-sequence ids, as `generate` uses them) and the
header of every `*.safetensors` file (names, shapes and dtypes of all tensors). Any problem is a
`UsageError` naming the file and the field. `CheckpointReader` then reads single tensors with
`safetensors.safe_open`, so a worker reads only the tensors of its part.

Configuration semantics follow `transformers`' config classes: a field missing from `config.json` takes that
class's default; what a field means for the model is its architecture module's (`serving.model.architectures`),
the sizes every architecture has are read here. The rotary base is `rope_parameters.rope_theta` (5.x) or
`rope_theta` (4.x); only the default (unscaled) rope is supported, except where an architecture reads a scaled
one (GPT-OSS's YaRN, Llama 4's Llama 3 scaling), and a `quantization_config` is refused unless the architecture
dequantizes its method (GPT-OSS's MXFP4 experts).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model import architectures
from mbridge_epoverlap.serving.model.architectures.base import ConfigFields, Source
from mbridge_epoverlap.serving.model.architectures.formats import fp8
from mbridge_epoverlap.serving.model.hf_layout import ARCHITECTURES, all_sources
from mbridge_epoverlap.serving.model.spec import DTYPES, ModelSpec

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")

# The config classes map `num_experts` to `num_local_experts` (Qwen checkpoints and OLMoE say `num_experts`;
# transformers 5.x saves Qwen3-MoE's as `num_local_experts`).
_ALIASES = {"num_experts": "num_local_experts"}

log = logging.getLogger(__name__)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")

# Rotary base of the recipes' public models (their config.json `rope_theta`).
_RECIPE_ROPE_THETA = {"qwen": 1e6, "mixtral": 1e6}


def load_spec(source: str | Path, *, seed: int = 0, num_layers: int | None = None,
              dtype: str = "float32") -> ModelSpec:
    """The `ModelSpec` of a checkpoint directory or a recipe name, checked up front.

    Args:
        source: a directory with `config.json` and `*.safetensors` (`MixtralForCausalLM` or
            `Qwen3MoeForCausalLM`), or a recipe name (`qwen3_30b_a3b`, `mixtral_8x22b`, ...) for a
            random model shrunk as the training runtime shrinks recipes for CPU.
        seed: initialisation seed of a recipe model.
        num_layers: MoE layers of a recipe model (its dense prefix is kept); None for the CPU default.
        dtype: "float32" or "bfloat16" (checkpoint tensors are converted on load).

    Raises:
        UsageError: unknown recipe or missing directory, missing or malformed `config.json`, an
            unsupported architecture or setting, a directory without safetensors, missing tensors or
            mismatched shapes; the message names the file and the field.
    """
    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    path = Path(source)
    if check_source(source) == "checkpoint":
        if num_layers is not None:
            raise UsageError(f"{path}: the layer count of a checkpoint is fixed by its {CONFIG}; "
                             "drop the layer override (it applies to recipe models only)")
        return _checkpoint_spec(path.resolve(), dtype)
    return _recipe_spec(str(source), seed=seed, num_layers=num_layers, dtype=dtype)


def check_source(source: str | Path) -> str:
    """"checkpoint" (a directory) or "recipe" (a recipe's name); anything else a usage error naming what to give.
    Cheap (no torch): the commands call it before their first word about the model."""
    from mbridge_epoverlap.recipes import RECIPES

    path = Path(source)
    if path.is_dir():
        return "checkpoint"
    if str(source) in RECIPES:
        return "recipe"
    if path.exists():
        raise UsageError(f"{path} is a file; give the checkpoint directory that holds {CONFIG} and *.safetensors")
    raise UsageError(f"{source!r} is neither a checkpoint directory nor a recipe; known recipes: "
                     f"{', '.join(RECIPES)}")


# --- checkpoints ------------------------------------------------------------------------------------

def _checkpoint_spec(directory: Path, dtype: str) -> ModelSpec:
    config_path = directory / CONFIG
    raw = _read_json(config_path, required=True)
    arch = architectures.get(_architecture(config_path, raw))
    raw = _resolve_aliases(config_path, raw)
    raw, names = arch.flatten_config(config_path, raw)
    raw = _resolve_aliases(config_path, raw)  # a nested config's own (a vision-language release's `text_config`)
    fp8_block = _fp8_block(config_path, raw, arch)
    cfg = ConfigFields(config_path, {**arch.defaults, **raw}, names)
    for name in arch.required:
        if name not in raw:
            also = [a for a, n in _ALIASES.items() if n == name]
            raise UsageError(f"{config_path}: field {cfg.name(name)!r}{''.join(f' (or {a!r})' for a in also)} is "
                             f"missing ({arch.name} needs it)")
    hidden = cfg.positive_int("hidden_size")
    layers = cfg.positive_int("num_hidden_layers")
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = heads if cfg.get("num_key_value_heads") is None else cfg.positive_int("num_key_value_heads")
    if heads % kv_heads:
        raise UsageError(f"{config_path}: field {cfg.name('num_attention_heads')!r} ({heads}) is not a multiple of "
                         f"{cfg.name('num_key_value_heads')!r} ({kv_heads})")
    head_dim = hidden // heads if cfg.get("head_dim") is None else cfg.positive_int("head_dim")
    if head_dim % 2:
        raise UsageError(f"{config_path}: field {cfg.name('head_dim')!r} is {head_dim}; rotary embeddings need an "
                         "even head size")
    if cfg.get("hidden_act") != "silu":
        raise UsageError(f"{config_path}: field {cfg.name('hidden_act')!r} is {cfg.get('hidden_act')!r}; only 'silu' "
                         "(SwiGLU experts) is supported")
    experts_field = "num_local_experts"
    experts, top_k = cfg.positive_int(experts_field), cfg.positive_int("num_experts_per_tok")
    if top_k > experts:
        raise UsageError(f"{config_path}: field {cfg.name('num_experts_per_tok')!r} ({top_k}) exceeds "
                         f"{cfg.name(experts_field)!r} "
                         f"({experts})")
    semantics = arch.read_config(cfg, layers)
    layers = semantics.pop("num_layers", layers)  # Nemotron-H pairs its blocks into fewer layers
    moe_layers = semantics["moe_layers"]
    if not any(moe_layers):
        raise UsageError(f"{config_path}: no layer is a MoE layer (fields 'mlp_only_layers', "
                         "'decoder_sparse_step'); expert-parallel serving needs experts")
    rope_theta = _rope_theta(config_path, cfg, arch.rope_types)
    files = _tensor_files(directory, arch.tensor_prefixes)
    spec = ModelSpec(
        architecture=arch.name, source=str(directory), num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=cfg.positive_int("vocab_size"), num_experts=experts,
        top_k=top_k, norm_eps=cfg.positive_float("rms_norm_eps"), rope_theta=rope_theta,
        tie_word_embeddings=cfg.boolean("tie_word_embeddings"), eos_token_ids=_eos_ids(directory, cfg),
        dtype=dtype, tensor_files=tuple(sorted(files.items())), fp8_block=fp8_block,
        tensor_prefixes=arch.tensor_prefixes, **semantics,
    )
    _check_tensors(directory, spec, files)
    _log_layers_past_the_model(directory, spec, files)
    return spec


def _fp8_block(path: Path, raw: dict[str, Any], arch: Any) -> tuple[int, int] | None:
    """The FP8 block size of a block-scaled checkpoint (`architectures.formats.fp8`), None for an unquantized one; any
    other `quant_method` than the architecture's own (GPT-OSS's MXFP4) is refused naming what is supported."""
    if raw.get("quantization_config") is None:
        return None
    method = _quant_method(raw)
    if method == fp8.METHOD and fp8.METHOD in arch.quantizations:
        return fp8.read_block(path, raw["quantization_config"])
    if method is not None and method in arch.quantizations:
        return None  # the architecture reads its own format
    supported = " or ".join(repr(m) for m in arch.quantizations) or "none"
    raise UsageError(f"{path}: field 'quantization_config.quant_method' is {method!r}; {arch.name} checkpoints are "
                     f"served unquantized or quantized as {supported} (FP8: block-scaled e4m3 weights with "
                     "'weight_scale_inv'); give the bf16/fp32 weights or the FP8 release")


def _log_layers_past_the_model(directory: Path, spec: ModelSpec, files: dict[str, str]) -> None:
    """Name the layers a checkpoint stores past `num_hidden_layers` (DeepSeek-V3's and GLM-4.5's multi-token
    prediction layers): they are not part of the model `generate` runs, so they are not read."""
    layers = {int(m.group(1)) for name in files if (m := _LAYER.match(name))}
    extra = sorted(i for i in layers if i >= spec.num_layers)
    if extra:
        log.warning("%s: skipping layers %s past num_hidden_layers (%d): multi-token prediction layers are not served",
                    directory, ", ".join(map(str, extra)), spec.num_layers)


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise UsageError(f"{path} is missing: a checkpoint directory needs {path.name} "
                             f"(a Hugging Face {' or '.join(ARCHITECTURES)} config)")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path} cannot be read: {err}") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _architecture(path: Path, raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise UsageError(f"{path}: field 'architectures' is missing or empty; it must name one of "
                         f"{', '.join(ARCHITECTURES)}")
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise UsageError(f"{path}: field 'architectures' is {archs}; supported: {', '.join(ARCHITECTURES)}")
    return known[0]


def _resolve_aliases(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for alias, name in _ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if name in out and out[name] != value:
            raise UsageError(f"{path}: fields {alias!r} ({value!r}) and {name!r} ({out[name]!r}) disagree")
        out[name] = value
    return out


def _rope_theta(path: Path, cfg: ConfigFields, kinds: tuple[str, ...] = ("default",)) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise UsageError(f"{path}: field 'rope_parameters' must be an object, found {params!r}")
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in kinds:
        if kinds == ("default",):
            raise UsageError(f"{path}: field 'rope_parameters.rope_type' is {kind!r}; only the default rope is "
                             "supported (no rope scaling)")
        raise UsageError(f"{path}: field 'rope_parameters.rope_type' is {kind!r}; supported: "
                         f"{', '.join(repr(k) for k in kinds)}")
    if "rope_theta" in params:
        return ConfigFields(path, {"rope_parameters.rope_theta": params["rope_theta"]}).positive_float(
            "rope_parameters.rope_theta")
    return cfg.positive_float("rope_theta")


def _eos_ids(directory: Path, cfg: ConfigFields) -> tuple[int, ...]:
    """End-of-sequence ids as `generate` uses them: generation_config.json's, else config.json's."""
    gen_path = directory / GENERATION_CONFIG
    generation = _read_json(gen_path, required=False)
    path, value = (gen_path, generation["eos_token_id"]) if "eos_token_id" in generation else (
        cfg.path, cfg.get("eos_token_id"))
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise UsageError(f"{path}: field 'eos_token_id' is {value!r}; it must be a token id or a list of them")
    return tuple(values)


def logical_name(stored: str, prefixes: Sequence[tuple[str, str]]) -> str:
    """A tensor's name as the architecture reads it: a stored name under a `prefixes` entry's stored prefix
    (`model.language_model.` of a vision-language checkpoint) under its logical one (`model.`)."""
    for logical, stored_prefix in prefixes:
        if stored.startswith(stored_prefix):
            return logical + stored[len(stored_prefix):]
    return stored


def stored_name(logical: str, prefixes: Sequence[tuple[str, str]]) -> str:
    """The name a tensor has in the files: `logical_name` undone."""
    for logical_prefix, stored_prefix in prefixes:
        if logical.startswith(logical_prefix):
            return stored_prefix + logical[len(logical_prefix):]
    return logical


def _tensor_files(directory: Path, prefixes: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
    """Tensor name (logical: `logical_name`) -> file name, from the header of every *.safetensors file (no tensor
    data is read)."""
    from safetensors import safe_open

    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise UsageError(f"{directory} has no *.safetensors files (the checkpoint's weights); "
                         "save the model with save_pretrained(..., safe_serialization=True)")
    files: dict[str, str] = {}
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as handle:
                names = list(handle.keys())
        except Exception as err:  # safetensors raises its own error types for a bad header
            raise UsageError(f"{path} is not a readable safetensors file: {err}") from None
        for name in names:
            logical = logical_name(name, prefixes)
            if logical in files:
                raise UsageError(f"{path}: tensor {name!r} is also in {files[logical]}; each tensor must be in one "
                                 "file")
            files[logical] = path.name
    return files


def _check_tensors(directory: Path, spec: ModelSpec, files: dict[str, str]) -> None:
    """Every tensor the model reads exists, with the shape the config implies and a float dtype."""
    from safetensors import safe_open

    # a fused tensor (every expert's rows in one) is wanted once per expert: check it once
    wanted = list(dict.fromkeys((name, shape, source.fields) for source in all_sources(spec)
                                for name, shape in source.parts))
    missing = [name for name, _, _ in wanted if name not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise UsageError(f"{directory}: the *.safetensors files lack {len(missing)} tensor(s) that {CONFIG} "
                         f"({spec.architecture}) implies: {shown}")
    by_file: dict[str, list[tuple[str, tuple[int, ...], tuple[str, ...]]]] = {}
    for name, shape, fields in wanted:
        by_file.setdefault(files[name], []).append((name, shape, fields))
    fp8_weights: dict[str, tuple[int, ...]] = {}  # weight stored as FP8 -> its shape (scales checked after)
    for file_name, tensors in by_file.items():
        with safe_open(str(directory / file_name), framework="pt") as handle:
            for name, shape, fields in tensors:
                view = handle.get_slice(stored_name(name, spec.tensor_prefixes))
                found, dtype = tuple(view.get_shape()), view.get_dtype()
                if found != shape:
                    raise UsageError(f"{directory / file_name}: tensor {name!r} has shape {list(found)}, but "
                                     f"{CONFIG} implies {list(shape)} from its fields "
                                     f"{', '.join(repr(f) for f in fields)}")
                if dtype == fp8.STORED_DTYPE:
                    fp8_weights[name] = found
                elif dtype not in FLOAT_DTYPES and not (dtype == "U8" and _is_mxfp4(spec, name)) and not (
                        dtype in ("I64", "I32") and name.endswith(".tid2eid")):  # DeepSeek-V4's hash routing table
                    raise UsageError(f"{directory / file_name}: tensor {name!r} has dtype {dtype}; "
                                     f"expected one of {', '.join(FLOAT_DTYPES)}")
    if fp8_weights:
        _check_fp8_scales(directory, spec, files, fp8_weights)


def _check_fp8_scales(directory: Path, spec: ModelSpec, files: dict[str, str],
                      weights: dict[str, tuple[int, ...]]) -> None:
    """Each F8_E4M3 weight (name -> shape) has a scale grid beside it that its block size implies; each file holding
    scales is opened once, as for the weights."""
    from safetensors import safe_open

    first = next(iter(weights))
    if spec.fp8_block is None:
        raise UsageError(f"{directory / files[first]}: tensor {first!r} is stored as {fp8.STORED_DTYPE}, but {CONFIG} "
                         "has no FP8 'quantization_config' (quant_method 'fp8' with its 'weight_block_size')")
    by_file: dict[str, list[str]] = {}
    for name, shape in weights.items():
        scale = fp8.scale_name(name)
        if scale not in files:
            raise UsageError(f"{directory}: tensor {name!r} is {fp8.STORED_DTYPE} {list(shape)} but its scale "
                             f"{scale!r} is in no *.safetensors file")
        by_file.setdefault(files[scale], []).append(name)
    for file_name, names in by_file.items():
        with safe_open(str(directory / file_name), framework="pt") as handle:
            for name in names:
                shape, scale = weights[name], fp8.scale_name(name)
                view = handle.get_slice(stored_name(scale, spec.tensor_prefixes))
                found, dtype = tuple(view.get_shape()), view.get_dtype()
                expected = fp8.scale_shape(shape, spec.fp8_block)
                if len(shape) != 2 or found != expected:
                    raise UsageError(f"{directory / file_name}: tensor {scale!r} has shape {list(found)}, but weight "
                                     f"{name!r} {list(shape)} in blocks of {list(spec.fp8_block)} (field "
                                     f"'quantization_config.weight_block_size') needs {list(expected)}")
                if dtype not in fp8.SCALE_DTYPES:
                    raise UsageError(f"{directory / file_name}: tensor {scale!r} has dtype {dtype}; expected one of "
                                     f"{', '.join(fp8.SCALE_DTYPES)}")


def _quant_method(raw: dict[str, Any]) -> Any:
    """`quantization_config.quant_method` (None when the field is not an object)."""
    config = raw.get("quantization_config")
    return config.get("quant_method") if isinstance(config, dict) else None


def _is_mxfp4(spec: ModelSpec, name: str) -> bool:
    """Whether `name` is an MXFP4 expert tensor (uint8 blocks and scales, `architectures.formats.mxfp4`)."""
    return spec.expert_quantization == "mxfp4" and name.endswith(("_blocks", "_scales"))


class CheckpointReader:
    """Reads single tensors of a checkpoint, opening each safetensors file once (memory-mapped)."""

    def __init__(self, spec: ModelSpec) -> None:
        if not spec.is_checkpoint:
            raise ValueError(f"{spec.source} is a recipe model; it has no checkpoint to read")
        self.directory = Path(spec.source)
        self.files = spec.file_of()
        self.fp8_block = spec.fp8_block
        self._handles: dict[str, Any] = {}
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}
        self.prefixes = spec.tensor_prefixes

    def _stored(self, name: str) -> str:
        return stored_name(name, self.prefixes)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` as stored (dtype converted by the caller); an FP8 weight dequantized to fp32 with its
        scales (`architectures.formats.fp8`)."""
        tensor = self._handle(name).get_tensor(self._stored(name))
        if self.is_fp8(name):
            return fp8.dequantize(tensor, self.get(fp8.scale_name(name)), self.fp8_block)
        return tensor

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor `name` (dim 0), reading only those rows (one expert of a fused
        tensor) and, for an FP8 weight, only the scale rows of their blocks."""
        rows = self._handle(name).get_slice(self._stored(name))[start:stop]
        if self.is_fp8(name):
            b0 = self.fp8_block[0]
            scale = fp8.scale_name(name)
            scales = self._handle(scale).get_slice(self._stored(scale))[start // b0:-(-stop // b0)]
            return fp8.dequantize(rows, scales, self.fp8_block, first_row=start)
        return rows

    def row_scales(self, source: Source) -> torch.Tensor | None:
        """Each row's FP8 scales of the parameter `source` describes, [rows, ceil(in / b1)] (its block row's), where
        every tensor of it is stored as FP8 and none is transposed; else None."""
        import torch

        if source.transpose or not all(self.is_fp8(name) for name, _ in source.parts):
            return None
        pieces = []
        for (name, shape), span in zip(source.parts, source.row_ranges(), strict=True):
            start, stop = span or (0, shape[0])
            scales = self.get(fp8.scale_name(name)).float()
            pieces.append(scales.index_select(0, torch.arange(start, stop) // self.fp8_block[0]))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def is_fp8(self, name: str) -> bool:
        """Whether `name` is stored as FP8 with a scale beside it (`load_spec` checked the pair)."""
        return (self.fp8_block is not None
                and self._handle(name).get_slice(self._stored(name)).get_dtype() == fp8.STORED_DTYPE)

    def byte_offset(self, name: str, row: int = 0) -> int:
        """Where row `row` of tensor `name` starts in its file, in bytes (a memory map of the file puts it there)."""
        file_name = self.files[name]
        if file_name not in self._headers:
            with open(self.directory / file_name, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                self._headers[file_name] = (8 + length, json.loads(handle.read(length)))
        data_start, header = self._headers[file_name]
        entry = header[self._stored(name)]
        rows = entry["shape"][0] if entry["shape"] else 1
        row_bytes = (entry["data_offsets"][1] - entry["data_offsets"][0]) // max(rows, 1)
        return data_start + entry["data_offsets"][0] + row * row_bytes

    def _handle(self, name: str) -> Any:
        """The open file holding tensor `name`."""
        from safetensors import safe_open

        file_name = self.files.get(name)
        if file_name is None:
            raise UsageError(f"{self.directory}: tensor {name!r} is not in any *.safetensors file")
        handle = self._handles.get(file_name)
        if handle is None:
            handle = safe_open(str(self.directory / file_name), framework="pt")
            self._handles[file_name] = handle
        return handle

    def read(self, source: Source) -> torch.Tensor:
        """The parameter `source` describes: its tensors (or their row ranges) stacked along dim 0, transposed
        where it says."""
        import torch

        pieces = [self.get(name) if span is None else self.rows(name, *span)
                  for (name, _), span in zip(source.parts, source.row_ranges(), strict=True)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out.t() if source.transpose else out

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- recipes ----------------------------------------------------------------------------------------

def _recipe_spec(name: str, *, seed: int, num_layers: int | None, dtype: str) -> ModelSpec:
    """A recipe's model shrunk as the training runtime shrinks it for one CPU process, routing left free."""
    from mbridge_epoverlap.config.shrink import CpuShape, shrink_for_cpu
    from mbridge_epoverlap.recipes.loader import family_of, load_recipe

    if num_layers is not None and num_layers < 1:
        raise UsageError(f"--layers {num_layers}: a model needs at least one MoE layer")
    shape = CpuShape(force_balanced_routing=False, **({"num_layers": num_layers} if num_layers else {}))
    m = shrink_for_cpu(load_recipe(name), 1, shape=shape).model
    freq = m.moe_layer_freq
    moe_layers = tuple(bool(v) for v in freq) if isinstance(freq, list) else tuple(
        i % freq == 0 for i in range(m.num_layers))
    heads = m.num_attention_heads
    return ModelSpec(
        architecture="recipe", source=name, num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=heads,
        num_kv_heads=m.num_query_groups or heads, head_dim=m.kv_channels or m.hidden_size // heads,
        vocab_size=m.vocab_size, num_experts=m.num_moe_experts or 1, top_k=m.moe_router_topk,
        expert_ffn=m.moe_ffn_hidden_size or m.ffn_hidden_size, moe_layers=moe_layers,
        dense_ffn=(m.ffn_hidden_size or 4 * m.hidden_size) if not all(moe_layers) else 0,
        shared_expert_ffn=m.moe_shared_expert_intermediate_size or 0, qk_norm=m.qk_layernorm,
        normalization=m.normalization, norm_eps=1e-6 if m.normalization == "RMSNorm" else 1e-5,
        norm_topk_prob=True, rope_theta=_RECIPE_ROPE_THETA.get(family_of(name) or "", 10000.0),
        dtype=dtype, seed=seed,
    )


RECIPE_CONTEXT = 4096  # the context of a recipe model (it has no config.json to say)


def context_length(spec: ModelSpec) -> int:
    """The longest sequence (prompt and generated tokens) the model takes: a checkpoint's
    `max_position_embeddings`, a recipe's `RECIPE_CONTEXT`."""
    if spec.is_checkpoint:
        path = Path(spec.source) / CONFIG
        raw, _ = architectures.get(spec.architecture).flatten_config(path, _read_json(path, required=True))
        value = raw.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return RECIPE_CONTEXT
