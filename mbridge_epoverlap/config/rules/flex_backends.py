"""Rules of the flex backends' newer settings: the rank capacity factor, NCCL EP's modes and wire dtypes, and
Transformer Engine's grouped-tensor path (Megatron-Core 0.18 on; most of them Megatron-Core main, 0.20).
"static_shape" is 0.19's `moe_ncclep_static_shape`, which main replaced by the rank capacity factor (set: static
shapes; unset: eager mode).

Two kinds, told apart by `core_enforces`: Megatron-Core's `TransformerConfig.__post_init__` checks (the job
stops at start-up) and the NCCL EP dispatcher's own checks in `token_dispatcher.py` (`_NCCLEPManager.__init__`,
the job stops when the first MoE layer is built, on its GPUs). What each release holds:

| check                                                  | 0.18 | 0.19          | 0.20 (main)              |
|--------------------------------------------------------|------|---------------|--------------------------|
| rank capacity factor needs hybridep (0.19 on: ncclep)  | yes  | yes           | yes                      |
| rank capacity factor with hybridep needs the op fuser  | any  | yes           | or grouped tensor, #6000 |
| NCCL EP static shapes need op fuser and grouped GEMM   | no   | static_shape  | capacity factor, #6229   |
| NCCL EP zero copy needs static shapes                  | no   | static_shape  | capacity factor, #6229   |
| NCCL EP refuses drop-and-pad                           | no   | no            | yes, #6229               |
| wire dtypes need ncclep; mxfp8 op fuser + grouped GEMM | no   | no            | yes, #6524               |
| ncclep refuses the grouped tensor without the op fuser | no   | no            | yes, #6000               |
| the grouped tensor needs grouped GEMM                  | no   | no            | yes, #6000               |
| zero copy with EP overlap: one more copy (warning)     | no   | yes           | yes, #5735               |

Megatron-Core 0.19's own requirement that NCCL EP always has a rank capacity factor (0.19 sizes the receive buffer
from it in both of its modes) is not modelled here: it would change what the validator says about 0.19
configurations it accepts today.
"""

from __future__ import annotations

from mbridge_epoverlap.config.rules.registry import MCORE_ASSERT, OVERLAP_OFF, OVERLAP_ON, RuleContext, rule, violation
from mbridge_epoverlap.config.violations import Violation

_AT_BUILD = "the config is accepted; the job stops when the first MoE layer builds its NCCL EP dispatcher, with a " \
            "`ValueError`"
_TC = "Megatron-Core main: transformer/transformer_config.py"
_DISPATCHER = "Megatron-Core main: transformer/moe/token_dispatcher.py"
_NCCLEP = ("model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=ncclep")
_FUSED = ("model.use_transformer_engine_op_fuser=true", "model.moe_grouped_gemm=true")


def _ncclep(ctx: RuleContext) -> bool:
    """NCCL EP is the dispatcher the layers build (flex with the ncclep backend)."""
    return ctx.get("moe_token_dispatcher_type") == "flex" and ctx.get("moe_flex_dispatcher_backend") == "ncclep"


def _fused_gemm(ctx: RuleContext) -> bool:
    """Transformer Engine's fused grouped GEMM: the op fuser over grouped experts."""
    return bool(ctx.get("use_transformer_engine_op_fuser") and ctx.get("moe_grouped_gemm"))


def _wire_dtypes(ctx: RuleContext) -> list[str]:
    return [f"{name}={ctx.get(name)!r}" for name in ("moe_dispatch_fwd_dtype", "moe_combine_bwd_dtype")
            if (ctx.get(name) or "bf16") != "bf16"]


@rule("rank_capacity_backend", "always", "Megatron-Core >= 0.18 (transformer_config.py)",
      "moe_expert_rank_capacity_factor only with the hybridep (0.19 on: or ncclep) flex backend",
      symptom=f"{MCORE_ASSERT} (a `ValueError`: \"moe_expert_rank_capacity_factor requires "
              "moe_flex_dispatcher_backend to be 'hybridep' or 'ncclep'\")",
      cause="the per-rank token budget is a HybridEP (and NCCL EP) buffer size; the other dispatchers have no such "
            "buffer. Megatron-Core reads the backend field whatever the dispatcher, and its default is deepep",
      where="`model.moe_expert_rank_capacity_factor`, `--moe_flex_dispatcher_backend`",
      example=("model.moe_expert_rank_capacity_factor=1.5",),
      versions="Megatron-Core >= 0.18 (hybridep only on 0.18)",
      core_enforces=lambda core: core.has_rank_capacity_factor,
      in_release=lambda _bridge, core: core.has_rank_capacity_factor)
def _rank_capacity_backend(ctx: RuleContext) -> Violation | None:
    factor = ctx.get("moe_expert_rank_capacity_factor")
    backend = ctx.get("moe_flex_dispatcher_backend")
    allowed = ("hybridep", "ncclep") if ctx.core.has_ncclep else ("hybridep",)
    if factor is None or backend in allowed:
        return None
    return violation("rank_capacity_backend",
                     f"moe_expert_rank_capacity_factor={factor} needs the {' or '.join(allowed)} flex backend on "
                     f"Megatron-Core {ctx.core.version}, but moe_flex_dispatcher_backend={backend!r}",
                     "--moe_flex_dispatcher_backend hybridep, or model.moe_expert_rank_capacity_factor=null")


@rule("rank_capacity_hybridep_fuser", "always", "Megatron-Core >= 0.18 (transformer_config.py)",
      "moe_expert_rank_capacity_factor with hybridep needs the TE op fuser (main: or moe_use_grouped_tensor)",
      symptom=f"{MCORE_ASSERT} (a `ValueError`: \"moe_expert_rank_capacity_factor with the 'hybridep' backend "
              "requires use_transformer_engine_op_fuser\")",
      cause="with a token budget HybridEP hands the experts a padded buffer that only Transformer Engine's fused "
            "grouped path (the op fuser; on main also the grouped tensor, #6000) reads by per-expert counts",
      where="`model.moe_expert_rank_capacity_factor`, `model.use_transformer_engine_op_fuser`, "
            "`model.moe_use_grouped_tensor`",
      example=("model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=hybridep",
               "model.moe_expert_rank_capacity_factor=1.5"),
      versions="Megatron-Core >= 0.18 (0.18: whatever the backend; main also accepts moe_use_grouped_tensor)",
      core_enforces=lambda core: core.has_rank_capacity_factor,
      in_release=lambda _bridge, core: core.has_rank_capacity_factor)
def _rank_capacity_hybridep_fuser(ctx: RuleContext) -> Violation | None:
    factor = ctx.get("moe_expert_rank_capacity_factor")
    if factor is None or ctx.get("use_transformer_engine_op_fuser"):
        return None
    backend = ctx.get("moe_flex_dispatcher_backend")
    if ctx.core.has_ncclep and backend != "hybridep":  # 0.18 asks for the op fuser whatever the backend
        return None
    if ctx.core.has_grouped_tensor and ctx.get("moe_use_grouped_tensor"):
        return None
    alternatives = "model.use_transformer_engine_op_fuser=true"
    if ctx.core.has_grouped_tensor:
        alternatives += ", or model.moe_use_grouped_tensor=true"
    return violation("rank_capacity_hybridep_fuser",
                     f"moe_expert_rank_capacity_factor={factor} with the {backend!r} backend needs "
                     "use_transformer_engine_op_fuser"
                     + (" or moe_use_grouped_tensor (#6000)" if ctx.core.has_grouped_tensor else "")
                     + f" on Megatron-Core {ctx.core.version}",
                     f"{alternatives}, or model.moe_expert_rank_capacity_factor=null")


@rule("ncclep_static_fused_gemm", "always", "Megatron-Core >= 0.19 (token_dispatcher.py, at layer build)",
      "NCCL EP static shapes (main: a rank capacity factor; 0.19: moe_ncclep_static_shape) need the TE op fuser "
      "and grouped GEMM",
      symptom=f"{_AT_BUILD} (\"moe_expert_rank_capacity_factor with the 'ncclep' backend requires BOTH "
              "use_transformer_engine_op_fuser and moe_grouped_gemm\")",
      cause="with static shapes the experts get the whole fixed-size receive buffer, which only the fused grouped "
            "GEMM walks by the on-device per-expert counts; on main the rank capacity factor selects static shapes "
            "and leaving it unset selects eager mode (#6229)",
      where="`model.moe_expert_rank_capacity_factor`, `model.moe_ncclep_static_shape` (0.19), "
            "`model.use_transformer_engine_op_fuser`, `model.moe_grouped_gemm`",
      example=(*_NCCLEP, "model.moe_expert_rank_capacity_factor=1.5"),
      versions="Megatron-Core 0.19 (moe_ncclep_static_shape) and main (the rank capacity factor, #6229)",
      in_release=lambda _bridge, core: core.has_ncclep)
def _ncclep_static_fused_gemm(ctx: RuleContext) -> Violation | None:
    if not _ncclep(ctx) or _fused_gemm(ctx):
        return None
    if ctx.core.ncclep_capacity_picks_mode:
        factor = ctx.get("moe_expert_rank_capacity_factor")
        if factor is None:
            return None
        return violation("ncclep_static_fused_gemm",
                         f"NCCL EP with moe_expert_rank_capacity_factor={factor} runs static shapes, which need "
                         "use_transformer_engine_op_fuser and moe_grouped_gemm "
                         f"({_DISPATCHER}, #6229)",
                         f"{' '.join(_FUSED)}, or model.moe_expert_rank_capacity_factor=null (eager mode)")
    if not ctx.get("moe_ncclep_static_shape"):
        return None
    return violation("ncclep_static_fused_gemm",
                     "NCCL EP with moe_ncclep_static_shape=True needs use_transformer_engine_op_fuser and "
                     f"moe_grouped_gemm (Megatron-Core {ctx.core.version}, token_dispatcher.py)",
                     f"{' '.join(_FUSED)}, or model.moe_ncclep_static_shape=false")


@rule("ncclep_zero_copy", "always", "Megatron-Core >= 0.19 (token_dispatcher.py, at layer build)",
      "moe_ncclep_zero_copy needs static shapes (main: a rank capacity factor; 0.19: moe_ncclep_static_shape)",
      symptom=f"{_AT_BUILD} (\"moe_ncclep_zero_copy requires moe_expert_rank_capacity_factor\")",
      cause="the zero-copy path uses symmetric-memory buffers of a fixed [capacity, hidden] shape, which eager mode "
            "cannot resize per step",
      where="`model.moe_ncclep_zero_copy`, `model.moe_expert_rank_capacity_factor`",
      example=(*_NCCLEP, *_FUSED, "model.moe_ncclep_zero_copy=true"),
      versions="Megatron-Core 0.19 (moe_ncclep_static_shape) and main (the rank capacity factor, #6229)",
      in_release=lambda _bridge, core: core.has_ncclep)
def _ncclep_zero_copy(ctx: RuleContext) -> Violation | None:
    if not _ncclep(ctx) or not ctx.get("moe_ncclep_zero_copy"):
        return None
    if ctx.core.ncclep_capacity_picks_mode:
        if ctx.get("moe_expert_rank_capacity_factor") is not None:
            return None
        return violation("ncclep_zero_copy",
                         "moe_ncclep_zero_copy needs moe_expert_rank_capacity_factor (static shapes); without it "
                         f"NCCL EP runs eager mode, whose buffers change size per step ({_DISPATCHER}, #6229)",
                         "model.moe_expert_rank_capacity_factor=1.5 (a per-rank token budget), or "
                         "model.moe_ncclep_zero_copy=false")
    if ctx.get("moe_ncclep_static_shape"):
        return None
    return violation("ncclep_zero_copy",
                     f"moe_ncclep_zero_copy needs moe_ncclep_static_shape=True on Megatron-Core {ctx.core.version} "
                     "(token_dispatcher.py)",
                     "model.moe_ncclep_static_shape=true, or model.moe_ncclep_zero_copy=false")


@rule("ncclep_drop_and_pad", "always", "Megatron-Core main (token_dispatcher.py, #6229, at layer build)",
      "NCCL EP does not drop or pad tokens (no moe_expert_capacity_factor, no moe_pad_expert_input_to_capacity)",
      symptom=f"{_AT_BUILD} (\"drop and pad is not supported yet with the 'ncclep' backend\")",
      cause="NCCL EP's receive buffer is sized from the routed tokens (eager) or a rank budget (static); per-expert "
            "capacity dropping and padding is not implemented for it",
      where="`model.moe_expert_capacity_factor`, `model.moe_pad_expert_input_to_capacity`, "
            "`--moe_flex_dispatcher_backend`",
      example=(*_NCCLEP, "model.moe_expert_capacity_factor=1.0"),
      versions="Megatron-Core main (0.20)",
      in_release=lambda _bridge, core: core.ncclep_capacity_picks_mode)
def _ncclep_drop_and_pad(ctx: RuleContext) -> Violation | None:
    if not _ncclep(ctx):
        return None
    set_ = [f"{name}={ctx.get(name)!r}" for name in ("moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity")
            if ctx.get(name) not in (None, False)]
    if not set_:
        return None
    return violation("ncclep_drop_and_pad",
                     f"NCCL EP does not support drop-and-pad ({', '.join(set_)}) ({_DISPATCHER}, #6229)",
                     "model.moe_expert_capacity_factor=null model.moe_pad_expert_input_to_capacity=false, or "
                     "--moe_flex_dispatcher_backend hybridep")


@rule("a2a_dtype_needs_ncclep", "always", f"{_TC} (#6524)",
      "moe_dispatch_fwd_dtype / moe_combine_bwd_dtype other than bf16 need the ncclep flex backend",
      symptom=f"{MCORE_ASSERT} (a `ValueError`: \"moe_dispatch_fwd_dtype / moe_combine_bwd_dtype require the "
              "'ncclep' flex dispatcher backend\")",
      cause="only NCCL EP can send the dispatch forward and the combine backward as MXFP8 on the wire",
      where="`model.moe_dispatch_fwd_dtype`, `model.moe_combine_bwd_dtype`, `--moe_flex_dispatcher_backend`",
      example=(*_FUSED, "model.moe_dispatch_fwd_dtype=mxfp8"),
      example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Core main (0.20)", core_enforces=lambda core: core.has_a2a_dtypes,
      in_release=lambda _bridge, core: core.has_a2a_dtypes)
def _a2a_dtype_needs_ncclep(ctx: RuleContext) -> Violation | None:
    wire = _wire_dtypes(ctx)
    if not wire or _ncclep(ctx):
        return None
    return violation("a2a_dtype_needs_ncclep",
                     f"{', '.join(wire)} needs the ncclep flex backend ({_TC}, #6524)",
                     "--moe_flex_dispatcher_backend ncclep, or model.moe_dispatch_fwd_dtype=bf16 "
                     "model.moe_combine_bwd_dtype=bf16")


@rule("a2a_mxfp8_fused_gemm", "always", f"{_TC} (#6524)",
      "an mxfp8 dispatch/combine wire dtype needs the TE op fuser and grouped GEMM",
      symptom=f"{MCORE_ASSERT} (a `ValueError`: \"moe_dispatch_fwd_dtype / moe_combine_bwd_dtype = 'mxfp8' require "
              "BOTH use_transformer_engine_op_fuser and moe_grouped_gemm\")",
      cause="only the fused grouped GEMM consumes the pre-quantized MXFP8 payload that arrives",
      where="`model.moe_dispatch_fwd_dtype`, `model.moe_combine_bwd_dtype`, `model.use_transformer_engine_op_fuser`, "
            "`model.moe_grouped_gemm`",
      example=(*_NCCLEP, "model.moe_combine_bwd_dtype=mxfp8"),
      example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Core main (0.20)", core_enforces=lambda core: core.has_a2a_dtypes,
      in_release=lambda _bridge, core: core.has_a2a_dtypes)
def _a2a_mxfp8_fused_gemm(ctx: RuleContext) -> Violation | None:
    wire = _wire_dtypes(ctx)
    if not wire or _fused_gemm(ctx):
        return None
    return violation("a2a_mxfp8_fused_gemm",
                     f"{', '.join(wire)} needs use_transformer_engine_op_fuser and moe_grouped_gemm ({_TC}, #6524)",
                     f"{' '.join(_FUSED)}, or model.moe_dispatch_fwd_dtype=bf16 model.moe_combine_bwd_dtype=bf16")


@rule("ncclep_grouped_tensor_fuser", "always", f"{_TC} (#6000)",
      "with the ncclep backend, moe_use_grouped_tensor only with the TE op fuser",
      symptom=f"{MCORE_ASSERT} (a `ValueError`: \"moe_use_grouped_tensor=True without use_transformer_engine_op_fuser "
              "is not yet supported with the NCCL-EP dispatcher\")",
      cause="NCCL EP feeds the experts through the op fuser's grouped path; the device-init grouped linear module "
            "that #6000 added for the other dispatchers is not wired to it yet",
      where="`model.moe_use_grouped_tensor`, `model.use_transformer_engine_op_fuser`, `--moe_flex_dispatcher_backend`",
      example=(*_NCCLEP, "model.moe_use_grouped_tensor=true"),
      example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Core main (0.20)", core_enforces=lambda core: core.has_grouped_tensor,
      in_release=lambda _bridge, core: core.has_grouped_tensor)
def _ncclep_grouped_tensor_fuser(ctx: RuleContext) -> Violation | None:
    if ctx.get("moe_flex_dispatcher_backend") != "ncclep" or not ctx.get("moe_use_grouped_tensor"):
        return None
    if ctx.get("use_transformer_engine_op_fuser"):
        return None
    return violation("ncclep_grouped_tensor_fuser",
                     f"moe_use_grouped_tensor=True without use_transformer_engine_op_fuser is not supported with the "
                     f"ncclep backend ({_TC}, #6000)",
                     "model.use_transformer_engine_op_fuser=true, or model.moe_use_grouped_tensor=false, or "
                     "--moe_flex_dispatcher_backend hybridep")


@rule("grouped_tensor_needs_grouped_gemm", "always", f"{_TC} (#6000)",
      "moe_use_grouped_tensor needs moe_grouped_gemm",
      symptom=f"{MCORE_ASSERT} (a `ValueError`: \"moe_use_grouped_tensor=True requires moe_grouped_gemm=True\")",
      cause="the grouped tensor holds the weights of grouped experts; sequential experts have none",
      where="`model.moe_use_grouped_tensor`, `model.moe_grouped_gemm`",
      example=("model.moe_use_grouped_tensor=true", "model.moe_grouped_gemm=false"),
      example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Core main (0.20)", core_enforces=lambda core: core.has_grouped_tensor,
      in_release=lambda _bridge, core: core.has_grouped_tensor)
def _grouped_tensor_needs_grouped_gemm(ctx: RuleContext) -> Violation | None:
    if not ctx.get("moe_use_grouped_tensor") or ctx.get("moe_grouped_gemm"):
        return None
    return violation("grouped_tensor_needs_grouped_gemm",
                     f"moe_use_grouped_tensor=True needs moe_grouped_gemm=True ({_TC}, #6000)",
                     "model.moe_grouped_gemm=true, or model.moe_use_grouped_tensor=false")



@rule("ncclep_zero_copy_overlap", "overlap",
      "Megatron-Core >= 0.19 (token_dispatcher.py, #5735, at the first dispatch)",
      "NCCL EP zero copy with EP overlap costs one extra copy per dispatch backward (a warning)",
      symptom="the job runs; Megatron-Core warns once (\"moe_ncclep_zero_copy + overlap_moe_expert_parallel_comm ... "
              "staged into a symm buffer with one extra copy per dispatch-backward\") and the zero-copy gain shrinks",
      cause="the overlapped 1F1B schedule detaches the dispatch input, so the dispatch-backward gradient is not in "
            "symmetric memory and is staged into it",
      where="`model.moe_ncclep_zero_copy`, `--moe_a2a_overlap`",
      example=(OVERLAP_ON, *_NCCLEP, *_FUSED, "model.moe_expert_rank_capacity_factor=1.5",
               "model.moe_ncclep_zero_copy=true"),
      versions="Megatron-Core >= 0.19", in_release=lambda _bridge, core: core.has_ncclep)
def _ncclep_zero_copy_overlap(ctx: RuleContext) -> Violation | None:
    if not _ncclep(ctx) or not ctx.get("moe_ncclep_zero_copy"):
        return None
    return violation("ncclep_zero_copy_overlap",
                     "moe_ncclep_zero_copy with EP overlap stages every dispatch-backward gradient into symmetric "
                     "memory (one extra copy each; Megatron-Core token_dispatcher.py, #5735)",
                     f"model.moe_ncclep_zero_copy=false (A/B it: --ab model.moe_ncclep_zero_copy), or {OVERLAP_OFF}",
                     "warning")
