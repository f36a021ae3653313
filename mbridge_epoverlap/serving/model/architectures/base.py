"""`Architecture`: what one Hugging Face MoE architecture says in its config.json and where it keeps its tensors.

The base class describes the layout most MoE checkpoints share (`model.layers.{i}.self_attn.{q,k,v,o}_proj`,
`input_layernorm` / `post_attention_layernorm`, a router `{moe_block}.gate` and experts
`{moe_block}.experts.{e}.{gate,up,down}_proj`); an architecture module overrides only what differs, as
`transformers`' modular files do. Each architecture reads its semantic fields (`read_config`) into the
`ModelSpec`, and the shared pieces of `serving.model.layers` are built from those fields.

Also here: `ConfigFields`, typed reads of config.json fields (a wrong value is a `UsageError` naming the file
and the field), and `Source`, the checkpoint tensors (and their shapes) one serving parameter is built from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.spec import GroupedRouting, ModelSpec


@dataclass(frozen=True)
class Source:
    """Checkpoint tensors (name, shape) concatenated along dim 0 into one parameter, and the config.json
    fields their shapes come from (named when a shape does not match).

    `rows` (one entry per part, or empty for all whole): the part is rows [start, stop) of its tensor (dim 0),
    as when a checkpoint stores every expert of a layer in one fused tensor (DBRX). `transpose`: the parameter
    is the transpose of the concatenated rows (a down projection stored [ffn, hidden] rather than
    [hidden, ffn]). `shape` is always the whole stored tensor's, the one the checks compare.
    """

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    fields: tuple[str, ...] = ("hidden_size",)
    rows: tuple[tuple[int, int] | None, ...] = ()
    transpose: bool = False

    def row_ranges(self) -> tuple[tuple[int, int] | None, ...]:
        """Each part's row range (None: the whole tensor)."""
        return self.rows or (None,) * len(self.parts)


def one(name: str, *shape: int, fields: tuple[str, ...] = ("hidden_size",), rows: tuple[int, int] | None = None,
        transpose: bool = False) -> Source:
    """A parameter read from one tensor (or rows [start, stop) of it, transposed when `transpose`)."""
    return Source(((name, tuple(shape)),), fields, () if rows is None else (rows,), transpose)


def cat(*parts: tuple[str, tuple[int, ...]], fields: tuple[str, ...] = ("hidden_size",),
        rows: tuple[tuple[int, int] | None, ...] = ()) -> Source:
    """A parameter made of several tensors stacked along dim 0 (q, k, v; gate and up), each whole or the
    row range `rows` gives it."""
    if rows and len(rows) != len(parts):
        raise ValueError(f"{len(rows)} row ranges for {len(parts)} tensors")
    return Source(tuple(parts), fields, tuple(rows))


class ConfigFields:
    """Typed reads of config fields; a wrong type is a UsageError naming the file and the field."""

    def __init__(self, path: Path, values: dict[str, Any], names: dict[str, str] | None = None) -> None:
        self.path, self.values = path, values
        # key of `values` -> the field's name in the file, where an architecture stores it elsewhere (DBRX's
        # `d_model`, `attn_config.kv_n_heads`): messages name the field the user can find and fix
        self.names = names or {}

    def name(self, key: str) -> str:
        """The field's name as config.json spells it."""
        return self.names.get(key, key)

    def get(self, name: str) -> Any:
        return self.values.get(name)

    def bad(self, name: str, what: str) -> UsageError:
        return UsageError(f"{self.path}: field {self.name(name)!r} is {self.values.get(name)!r}; it must be {what}")

    def positive_int(self, name: str) -> int:
        value = self.values.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.bad(name, "a positive integer")
        return value

    def positive_float(self, name: str) -> float:
        value = self.values.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise self.bad(name, "a positive number")
        return float(value)

    def boolean(self, name: str) -> bool:
        value = self.values.get(name)
        if not isinstance(value, bool):
            raise self.bad(name, "true or false")
        return value

    def int_list(self, name: str, *, below: int) -> set[int]:
        value = self.values.get(name)
        if value is None:
            return set()
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < below
                                              for v in value):
            raise self.bad(name, f"a list of layer indices in [0, {below})")
        return set(value)

    def require(self, name: str, expected: Any, why: str) -> None:
        """The field must hold `expected` (its default): anything else is a feature the engine lacks."""
        if self.values.get(name) != expected:
            raise UsageError(f"{self.path}: field {self.name(name)!r} is {self.values.get(name)!r}; {why} is not "
                             f"supported (only {expected!r})")


ATTENTION_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def checked_routing(cfg: ConfigFields, routing: GroupedRouting) -> GroupedRouting:
    """`routing`, once it can route the config's experts (`GroupedRouting.check`); else a UsageError naming the
    fields and their values."""
    experts, top_k = cfg.positive_int("num_local_experts"), cfg.positive_int("num_experts_per_tok")
    try:
        routing.check(experts, top_k)
    except ValueError as err:
        raise UsageError(f"{cfg.path}: fields 'n_group' ({routing.n_group}), 'topk_group' ({routing.topk_group}), "
                         f"{cfg.name('num_local_experts')!r} ({experts}) and 'num_experts_per_tok' ({top_k}): "
                         f"{err}") from None
    return routing


def text_config(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's language model as a flat config: the `text_config` fields over the top level's
    (the top level keeps `architectures`, `quantization_config` and what the text config leaves out)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UsageError(f"{path}: field 'text_config' is {text!r}; a {raw.get('architectures')} checkpoint's "
                         "language model is described there")
    top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    flat = {**top, **text}
    if "tie_word_embeddings" in top:  # the top level's model owns the output head
        flat["tie_word_embeddings"] = top["tie_word_embeddings"]
    return flat


class Architecture:
    """One `architectures` entry of config.json: its defaults, its semantics and its tensor names.

    Class attributes (override in a subclass):
        name: the `architectures` entry (`MixtralForCausalLM`).
        summary: one line for the table of supported architectures.
        defaults: the transformers config class's defaults for fields a checkpoint may leave out.
        required: sizes every checkpoint must state.
        moe_block: the module holding a MoE layer's router and experts (`mlp`, `block_sparse_moe`).
        expert_projections: tensor names of an expert's gate, up and down projections.
        expert_ffn_field: the config field of an expert's FFN width.
        rope_types: the `rope_parameters.rope_type` values it serves (a scaled rope is its `read_config`'s to
            read into `rope_scaling`).
        tensor_prefixes: (logical prefix, stored prefix) pairs: where the checkpoint keeps the tensors the
            architecture reads under other names (a vision-language release's `model.language_model.`).
        quantizations: the `quantization_config.quant_method` values whose weights it dequantizes at load
            (any other quantized checkpoint is refused): FP8 block-scaled weights (`fp8`) for every architecture
            that reads its tensors through `Source`s.
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}
    required: ClassVar[tuple[str, ...]] = ()
    moe_block: ClassVar[str] = "mlp"
    expert_projections: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    expert_ffn_field: ClassVar[str] = "moe_intermediate_size"
    rope_types: ClassVar[tuple[str, ...]] = ("default",)
    quantizations: ClassVar[tuple[str, ...]] = ("fp8",)
    tensor_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()

    # --- config.json -> spec ------------------------------------------------------------------------

    def flatten_config(self, path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """config.json's fields under the names `checkpoint` reads (`hidden_size`, `num_key_value_heads`, ...),
        and for each renamed one the name it has in the file. Most architectures use those names already; one
        that nests or renames them (DBRX) maps them here."""
        return raw, {}

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        """The `ModelSpec` fields this architecture decides (which layers are MoE, FFN widths, attention and
        router variants). Shared sizes (hidden, heads, experts, rope, eos) are read by `checkpoint`."""
        raise NotImplementedError

    # --- spec -> tensors ----------------------------------------------------------------------------

    def attention_sources(self, spec: ModelSpec) -> dict[str, Source]:
        """Parameter name of `serving.model.parts.AttentionPart` -> its checkpoint tensors."""
        h = spec.hidden_size
        out = self.model_ends(spec, "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        for i in range(spec.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            out[f"{ours}.input_norm.weight"] = one(f"{hf}.input_layernorm.weight", h)
            out[f"{ours}.post_norm.weight"] = one(f"{hf}.post_attention_layernorm.weight", h)
            attention = self.mixer_tensors(spec, i, hf)
            out.update({f"{ours}.attention.{k}": v for k, v in attention.items()})
            if spec.is_moe(i):
                out.update({f"{ours}.{k}": v for k, v in self.moe_tensors(spec, f"{hf}.{self.moe_block}").items()})
            else:
                out.update({f"{ours}.mlp.{k}": v for k, v in self.mlp_tensors(f"{hf}.mlp", spec.dense_ffn, h,
                                                                               "intermediate_size").items()})
        return out

    @staticmethod
    def model_ends(spec: ModelSpec, embedding: str, final_norm: str, head: str, *,
                   hidden_field: str = "hidden_size") -> dict[str, Source]:
        """The embedding, the final norm and (unless the embeddings are tied) the output head, under the names the
        checkpoint gives them; `hidden_field` names the hidden size in messages."""
        h, vocab = spec.hidden_size, ("vocab_size", hidden_field)
        out = {"embedding": one(embedding, spec.vocab_size, h, fields=vocab),
               "final_norm.weight": one(final_norm, h, fields=(hidden_field,))}
        if not spec.tie_word_embeddings:
            out["head.weight"] = one(head, spec.vocab_size, h, fields=vocab)
        return out

    def mixer_tensors(self, spec: ModelSpec, layer: int, prefix: str) -> dict[str, Source]:
        """The tensors of layer `layer`'s token mixer (`prefix`: the layer's own, `model.layers.{i}`): its softmax
        attention here; a hybrid architecture returns its linear attention's for the layers that have one."""
        return self.attention_tensors(spec, f"{prefix}.self_attn")

    def attention_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        """Separate q, k, v (and o) projections, with biases (`qkv_bias`, `attention_out_bias`) and q/k norms where
        the spec has them (q's rows doubled where each head also has an output gate)."""
        h, d, hq, hkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
        f = ATTENTION_FIELDS
        q_rows = hq * d * (2 if spec.attention_output_gate else 1)
        out = {"qkv.weight": cat((f"{prefix}.q_proj.weight", (q_rows, h)), (f"{prefix}.k_proj.weight", (hkv * d, h)),
                                 (f"{prefix}.v_proj.weight", (hkv * d, h)), fields=f),
               "proj.weight": one(f"{prefix}.o_proj.weight", h, hq * d, fields=f)}
        if spec.qkv_bias:
            out["qkv_bias"] = cat((f"{prefix}.q_proj.bias", (q_rows,)), (f"{prefix}.k_proj.bias", (hkv * d,)),
                                  (f"{prefix}.v_proj.bias", (hkv * d,)), fields=f)
        if spec.attention_out_bias:
            out["proj_bias"] = one(f"{prefix}.o_proj.bias", h, fields=f)
        if spec.qk_norm:
            q_size, k_size = (d, d) if spec.qk_norm_scope == "head" else (hq * d, hkv * d)
            out["q_norm.weight"] = one(f"{prefix}.q_norm.weight", q_size, fields=f)
            out["k_norm.weight"] = one(f"{prefix}.k_norm.weight", k_size, fields=f)
        return out

    def moe_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        """The router of a MoE layer (and its shared expert, where the architecture has one)."""
        return {"router.weight": one(f"{prefix}.gate.weight", spec.num_experts, spec.hidden_size,
                                     fields=("num_local_experts", "hidden_size"))}

    @staticmethod
    def mlp_tensors(prefix: str, ffn: int, hidden: int, field: str) -> dict[str, Source]:
        """A dense SwiGLU MLP with `gate_proj`, `up_proj`, `down_proj` -> `fc1` (gate rows first), `fc2`."""
        fields = (field, "hidden_size")
        return {"fc1.weight": cat((f"{prefix}.gate_proj.weight", (ffn, hidden)),
                                  (f"{prefix}.up_proj.weight", (ffn, hidden)), fields=fields),
                "fc2.weight": one(f"{prefix}.down_proj.weight", hidden, ffn, fields=fields)}

    def expert_sources(self, spec: ModelSpec, layer: int, expert: int) -> tuple[Source, Source]:
        """(gate and up projections -> `w1[e]` [2*ffn, hidden], down projection -> `w2[e]` [hidden, ffn])."""
        h, f = spec.hidden_size, spec.expert_ffn
        prefix = f"model.layers.{layer}.{self.moe_block}.experts.{expert}"
        gate, up, down = (f"{prefix}.{p}.weight" for p in self.expert_projections)
        fields = (self.expert_ffn_field, "hidden_size")
        return cat((gate, (f, h)), (up, (f, h)), fields=fields), one(down, h, f, fields=fields)

    def expert_weights(self, reader: Any, spec: ModelSpec, layer: int, expert: int) -> dict[str, Any] | None:
        """One expert's serving tensors read from the checkpoint (`w1` [2*ffn, hidden], gate rows first, `w2`
        [hidden, ffn], and `b1` / `b2` where the spec has expert biases) by an architecture whose stored layout
        `expert_sources` cannot describe (GPT-OSS: fused, gate and up interleaved); None: read `expert_sources`."""
        return None

    # --- shared reads -------------------------------------------------------------------------------

    @staticmethod
    def sparse_layers(cfg: ConfigFields, num_layers: int) -> tuple[bool, ...]:
        """Qwen-style MoE layer choice: every `decoder_sparse_step`-th layer unless in `mlp_only_layers`."""
        step = cfg.positive_int("decoder_sparse_step")
        dense_only = cfg.int_list("mlp_only_layers", below=num_layers)
        return tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
