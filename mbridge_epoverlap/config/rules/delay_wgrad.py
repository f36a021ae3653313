"""Rules for delayed weight-gradient compute (`delay_wgrad_compute = True`)."""

from __future__ import annotations

from mbridge_epoverlap.config.environment import version_at_least
from mbridge_epoverlap.config.rules.registry import (
    BRIDGE_ASSERT,
    DELAY_KEY,
    DELAY_ON,
    MCORE_ASSERT,
    OVERLAP_KEY,
    OVERLAP_OFF,
    OVERLAP_ON,
    RuleContext,
    rule,
    violation,
)
from mbridge_epoverlap.config.violations import Violation

_TE_GRAPH_ATTN = (OVERLAP_ON, DELAY_ON, "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=attn",
                  "model.use_te_rng_tracker=true")


def _te_text(version: str | None) -> str:
    return f"TE {version}" if version else "no Transformer Engine"


@rule("delay_needs_overlap", "delay_wgrad", "Megatron-Core, Megatron-Bridge", "delay_wgrad_compute needs EP overlap",
      symptom=f"{MCORE_ASSERT} about delay_wgrad_compute",
      cause="delayed wgrad fills the dispatch-backward window that only EP overlap creates",
      where="`--moe_a2a_overlap`, `--delay_wgrad_compute`", example=(OVERLAP_OFF, DELAY_ON),
      core_enforces=lambda core: True)
def _delay_needs_overlap(ctx: RuleContext) -> Violation | None:
    if ctx.overlap:
        return None
    return violation("delay_needs_overlap", "delay_wgrad_compute needs overlap_moe_expert_parallel_comm=True",
                     f"{OVERLAP_KEY}=true, or {DELAY_KEY}=false")


@rule("delay_te_grad_reduce", "delay_wgrad", "Megatron-Bridge",
      "TE >= 2.7.0 when ddp.overlap_grad_reduce or comm_overlap.overlap_grad_reduce is on",
      symptom=f"{BRIDGE_ASSERT} (Transformer Engine version)",
      cause="before TE 2.7 the delayed weight gradients miss the grad-reduce hooks",
      where="`--te-version` (the job's container), `ddp.overlap_grad_reduce`",
      example=(OVERLAP_ON, DELAY_ON, "ddp.overlap_grad_reduce=true"), example_versions=(("--te-version", "2.6.0"),),
      bridge_enforces=lambda _bridge, _core: True)
def _delay_te_grad_reduce(ctx: RuleContext) -> Violation | None:
    if not ctx.overlap_grad_reduce or version_at_least(ctx.env.te_version, "2.7.0"):
        return None
    return violation("delay_te_grad_reduce",
                     "delay_wgrad_compute with overlap_grad_reduce needs Transformer Engine >= 2.7.0 "
                     f"({_te_text(ctx.env.te_version)})",
                     "use TE >= 2.7 in the job (give its version with --te_version), or "
                     f"comm_overlap.overlap_grad_reduce=false ddp.overlap_grad_reduce=false, or {DELAY_KEY}=false")


@rule("delay_te_grad_accum", "delay_wgrad", "Megatron-Bridge", "TE >= 2.7.0 when gradient_accumulation_fusion",
      symptom=f"{BRIDGE_ASSERT} (Transformer Engine version)",
      cause="before TE 2.7 fused gradient accumulation does not support delayed weight gradients",
      where="`--te-version`, `model.gradient_accumulation_fusion`",
      example=(OVERLAP_ON, DELAY_ON, "ddp.overlap_grad_reduce=false", "model.gradient_accumulation_fusion=true"),
      example_versions=(("--te-version", "2.6.0"),),
      bridge_enforces=lambda _bridge, _core: True)
def _delay_te_grad_accum(ctx: RuleContext) -> Violation | None:
    if not ctx.get("gradient_accumulation_fusion") or version_at_least(ctx.env.te_version, "2.7.0"):
        return None
    return violation("delay_te_grad_accum",
                     "delay_wgrad_compute with gradient_accumulation_fusion needs Transformer Engine >= 2.7.0 "
                     f"({_te_text(ctx.env.te_version)})",
                     f"use TE >= 2.7, or model.gradient_accumulation_fusion=false, or {DELAY_KEY}=false")


@rule("delay_cuda_graph_te", "delay_wgrad", "Megatron-Core >= 0.16",
      "delay_wgrad with transformer_engine CUDA graphs needs TE >= 2.10.0",
      versions="Megatron-Core >= 0.16 (0.15: a warning)",
      symptom=f"{MCORE_ASSERT} from Megatron-Core 0.16 on (Transformer Engine version)",
      cause="TE graphs before 2.10 cannot replay a layer whose weight gradients run later",
      where="`--te-version`, `--cuda_graph_impl`",
      example=(OVERLAP_ON, DELAY_ON, "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=moe_router",
               "model.use_te_rng_tracker=true"),
      example_versions=(("--te-version", "2.9.0"),),
      core_enforces=lambda core: core.delay_te_graph_needs_te_2_10)
def _delay_cuda_graph_te(ctx: RuleContext) -> Violation | None:
    if ctx.get("cuda_graph_impl") != "transformer_engine" or version_at_least(ctx.env.te_version, "2.10.0"):
        return None
    message = ("delay_wgrad_compute with cuda_graph_impl=transformer_engine needs Transformer Engine >= 2.10.0 "
               f"({_te_text(ctx.env.te_version)})")
    fix = f"use TE >= 2.10, or model.cuda_graph_impl=none, or {DELAY_KEY}=false"
    if ctx.core.delay_te_graph_needs_te_2_10:
        return violation("delay_cuda_graph_te", message, fix)
    return violation("delay_cuda_graph_te", f"{message}; Megatron-Core {ctx.core.version} does not check it", fix,
                     "warning")


def wgrad_in_graph(ctx: RuleContext) -> bool:
    """Whether a weight gradient is captured in a CUDA graph: attention graphed, or the router graphed with a
    shared expert that is not overlapped (its weights then sit in the graphed region).

    As Megatron-Bridge reads it: the graph modules of either field, whatever the implementation, `none`
    included. Its comm-overlap set-up (where these checks live) runs before `ConfigContainer.validate`
    clears the modules of a config without graphs, so leftover modules on a `none` config count.
    """
    scopes = ctx.graph_scopes()
    if "attn" in scopes:
        return True
    return "moe_router" in scopes and ctx.has_shared_expert() and not ctx.get("moe_shared_expert_overlap")


@rule("delay_graph_te", "delay_wgrad", "Megatron-Bridge", "wgrad inside a CUDA graph scope needs TE >= 2.12.0",
      symptom=f"{BRIDGE_ASSERT} (Transformer Engine version)",
      cause="a weight gradient inside a captured graph (attn scope, or moe_router with an un-overlapped shared "
            "expert) needs TE 2.12 to be split out",
      where="`--te-version`, `--cuda_graph_scope`",
      example=_TE_GRAPH_ATTN + ("model.gradient_accumulation_fusion=true",),
      example_versions=(("--te-version", "2.11.0"),),
      bridge_enforces=lambda _bridge, _core: True)
def _delay_graph_te(ctx: RuleContext) -> Violation | None:
    if not wgrad_in_graph(ctx) or version_at_least(ctx.env.te_version, "2.12.0"):
        return None
    return violation("delay_graph_te",
                     f"delay_wgrad_compute with weight gradients inside CUDA graphs (modules "
                     f"{sorted(ctx.graph_scopes())}) needs Transformer Engine >= 2.12.0 "
                     f"({_te_text(ctx.env.te_version)})",
                     "use TE >= 2.12, or take attn (and moe_router with a shared expert) out of "
                     f"model.cuda_graph_scope, or {DELAY_KEY}=false")


@rule("delay_graph_grad_accum", "delay_wgrad", "Megatron-Bridge",
      "wgrad inside a CUDA graph scope needs gradient_accumulation_fusion",
      symptom=f"{BRIDGE_ASSERT} (gradient_accumulation_fusion)",
      cause="graphed weight gradients are delayed through the fused accumulation path only",
      where="`model.gradient_accumulation_fusion`, `--cuda_graph_scope`", example=_TE_GRAPH_ATTN,
      bridge_enforces=lambda _bridge, _core: True)
def _delay_graph_grad_accum(ctx: RuleContext) -> Violation | None:
    if not wgrad_in_graph(ctx) or ctx.get("gradient_accumulation_fusion"):
        return None
    return violation("delay_graph_grad_accum",
                     "delay_wgrad_compute with weight gradients inside CUDA graphs needs "
                     "gradient_accumulation_fusion=True", "model.gradient_accumulation_fusion=true")


@rule("delay_graph_attn_bias", "delay_wgrad", "Megatron-Bridge",
      "attn in the graph scope needs add_bias_linear=False and add_qkv_bias=False",
      symptom=f"{BRIDGE_ASSERT} (attention biases)",
      cause="graphed attention with delayed wgrad does not handle bias gradients",
      where="`model.add_bias_linear`, `model.add_qkv_bias`, `--cuda_graph_scope`",
      example=_TE_GRAPH_ATTN + ("model.gradient_accumulation_fusion=true", "model.add_qkv_bias=true"),
      bridge_enforces=lambda _bridge, _core: True)
def _delay_graph_attn_bias(ctx: RuleContext) -> Violation | None:
    if not wgrad_in_graph(ctx) or "attn" not in ctx.graph_scopes():
        return None
    biased = [name for name in ("add_bias_linear", "add_qkv_bias") if ctx.get(name)]
    if not biased:
        return None
    return violation("delay_graph_attn_bias",
                     f"delay_wgrad_compute with attention in CUDA graphs does not support biases "
                     f"({', '.join(biased)}=True)",
                     " ".join(f"model.{name}=false" for name in biased)
                     + ", or remove attn from model.cuda_graph_scope")


@rule("delay_legacy_grouped_gemm", "delay_wgrad", "Megatron-Core 0.15-0.16", "not with moe_use_legacy_grouped_gemm",
      versions="Megatron-Core 0.15-0.16",
      symptom=f"{MCORE_ASSERT} about moe_use_legacy_grouped_gemm (Megatron-Core 0.15-0.16)",
      cause="the legacy grouped GEMM has no separate weight-gradient step",
      where="`model.moe_use_legacy_grouped_gemm`, `--mcore-version`",
      example=(OVERLAP_ON, DELAY_ON, "model.moe_use_legacy_grouped_gemm=true"),
      example_versions=(("--mcore-version", "0.16.0"),),
      core_enforces=lambda core: core.delay_rejects_legacy_grouped_gemm)
def _delay_legacy_grouped_gemm(ctx: RuleContext) -> Violation | None:
    if not ctx.get("moe_use_legacy_grouped_gemm") or not ctx.core.delay_rejects_legacy_grouped_gemm:
        return None
    return violation("delay_legacy_grouped_gemm",
                     f"delay_wgrad_compute does not work with the legacy grouped GEMM on Megatron-Core "
                     f"{ctx.core.version}", "model.moe_use_legacy_grouped_gemm=false")
