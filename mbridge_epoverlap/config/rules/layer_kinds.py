"""Rules about the kinds of layer a model stacks besides attention and MoE: hybrid Mamba stacks, linear attention.

Neither `TransformerConfig` nor Megatron-Bridge's `CommOverlapConfig` checks these with EP overlap (no release
0.15-0.19, nor main at d98e8a6 / Bridge 067f987); the job stops when the overlapped schedule first runs. Read from
the code each rule names. Other features of the late-2026 families were read too and are silent on EP overlap in
every release, so the validator is too: attention sinks (`softmax_type`), the Muon optimizer, DSA indexer losses,
and DeepSeek-V4's hash-routed layers and hyper-connections (checked only on Megatron-Core's `dev` branch).
"""

from __future__ import annotations

from mbridge_epoverlap.config.rules.registry import OVERLAP_OFF, OVERLAP_ON, RuleContext, rule, violation
from mbridge_epoverlap.config.violations import Violation

_OFF_FIX = (f"{OVERLAP_OFF} comm_overlap.delay_wgrad_compute=false (flags --moe_a2a_overlap and "
            "--delay_wgrad_compute), as Megatron-Bridge's recipes of these models keep it")


@rule("hybrid_stack", "overlap", "Megatron-Core (pipeline_parallel/combined_1f1b.py, at the first step)",
      "no EP overlap on a hybrid Mamba stack (hybrid_layer_pattern): only GPTModel builds the overlapped schedule",
      versions="every Megatron-Core release and main",
      symptom="the config is accepted; the first overlapped step stops with `RuntimeError: "
              "_get_attr_wrapped_model couldn't find attribute build_schedule_plan`",
      cause="combined 1F1B asks the model for `build_schedule_plan`, which GPTModel defines and MambaModel / "
            "HybridModel do not (0.15-0.19 and main; the hybrid stack's support is an open pull request)",
      where="`model.hybrid_layer_pattern` (Nemotron-H, Nemotron 3), `--moe_a2a_overlap`",
      example=(OVERLAP_ON, "model.hybrid_layer_pattern=MEM*EMEM*E"))
def _hybrid_stack(ctx: RuleContext) -> Violation | None:
    pattern = ctx.get("hybrid_layer_pattern")
    if not pattern:
        return None
    return violation("hybrid_stack",
                     f"EP overlap cannot run on a hybrid Mamba stack (hybrid_layer_pattern={pattern[:24]!r}"
                     f"{'...' if len(pattern) > 24 else ''}): Megatron-Core's overlapped schedule needs "
                     "build_schedule_plan, which only GPTModel has", _OFF_FIX)


@rule("linear_attention_core_016", "overlap", "Megatron-Core 0.16 (transformer/fine_grained_callables.py)",
      "gated DeltaNet linear attention with EP overlap needs Megatron-Core >= 0.17",
      versions="Megatron-Core 0.16 (fixed in 0.17, #2997)",
      symptom="the first overlapped step stops with `AttributeError: 'GatedDeltaNet' object has no attribute "
              "'backward_dw'`",
      cause="the overlapped layer wraps its attention's weight-gradient step, which GatedDeltaNet gained in 0.17",
      where="`model.experimental_attention_variant` (Qwen3-Next, Qwen3.5), `--mcore-version`",
      example=(OVERLAP_ON, "model.experimental_attention_variant=gated_delta_net", "model.linear_attention_freq=4"),
      example_versions=(("--mcore-version", "0.16.1"),),
      in_release=lambda _bridge, core: not core.at_least("0.17") and core.at_least("0.16"))
def _linear_attention_core_016(ctx: RuleContext) -> Violation | None:
    if ctx.get("experimental_attention_variant") != "gated_delta_net":
        return None
    return violation("linear_attention_core_016",
                     f"EP overlap with gated DeltaNet layers fails on Megatron-Core {ctx.core.version}: "
                     "GatedDeltaNet has no backward_dw before 0.17",
                     "run the job on Megatron-Core >= 0.17 (--mcore-version 0.17), or " + _OFF_FIX)


# `recompute_modules` values Megatron-Core's `TransformerConfig` accepts (read from each release tag's
# `allowed_modules`): 0.19 added gdn_norm_out (gated DeltaNet); main (0.20) the gated-DeltaNet projections and mHC.
_RECOMPUTE_MODULES = frozenset({"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"})
_RECOMPUTE_MODULES_0_19 = _RECOMPUTE_MODULES | {"gdn_norm_out"}
_RECOMPUTE_MODULES_MAIN = _RECOMPUTE_MODULES_0_19 | {"gdp_in_proj", "gdp_qkv", "mhc"}


def recompute_modules_allowed(ctx: RuleContext) -> tuple[str, frozenset[str]]:
    """(the Megatron-Core release, the recompute modules it knows). Main's only on a Megatron-Bridge main job:
    Megatron-Core main (0.20) is built against nothing else."""
    if ctx.core.at_least("0.20") and ctx.bridge.is_main:
        return "main (0.20)", _RECOMPUTE_MODULES_MAIN
    if ctx.core.at_least("0.19"):
        return "0.19", _RECOMPUTE_MODULES_0_19
    return ctx.core.version, _RECOMPUTE_MODULES


@rule("recompute_modules_known", "always", "Megatron-Core (TransformerConfig)",
      "every recompute_modules entry is one the Megatron-Core release knows",
      versions="all releases (0.19 adds gdn_norm_out; main adds gdp_in_proj, gdp_qkv and mhc)",
      symptom="Megatron-Core's `TransformerConfig` stops at start-up with an `AssertionError` (\"Invalid choices for "
              "recompute_modules\")",
      cause="a recipe written for a newer Megatron-Core (DeepSeek-V4's recompute of its mHC hyper-connections) names "
            "a module the job's release cannot recompute",
      where="`model.recompute_modules`, `--recompute_modules`, `--mcore-version`",
      example=("model.recompute_granularity=selective", "model.recompute_modules=[mhc]"),
      example_versions=(("--mcore-version", "0.19.0"),), core_enforces=lambda _core: True)
def _recompute_modules_known(ctx: RuleContext) -> Violation | None:
    if ctx.get("recompute_granularity") != "selective":
        return None
    release, allowed = recompute_modules_allowed(ctx)
    unknown = sorted(set(ctx.get("recompute_modules") or []) - allowed)
    if not unknown:
        return None
    kept = [m for m in ctx.get("recompute_modules") or [] if m in allowed]
    return violation("recompute_modules_known",
                     f"Megatron-Core {release} cannot recompute {unknown} (recompute_modules); it knows "
                     f"{', '.join(sorted(allowed))}",
                     f"model.recompute_modules=[{','.join(kept)}]" if kept else "model.recompute_modules=null, or a "
                     "job on the Megatron-Core the recipe was written for (--mcore-version)")
