"""Every constraint of EP overlap and delayed wgrad, one small function per rule.

Each rule has a stable id, says when it applies (EP overlap on, delayed wgrad on, or always), where
the constraint comes from, and returns a `Violation` (with a fix a user can paste) or None.
`all_rules()` lists them for the validator, the docs and the CLI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from mbridge_epoverlap.config.environment import Environment, version_at_least
from mbridge_epoverlap.config.layout import largest_divisor
from mbridge_epoverlap.config.model import model_attr
from mbridge_epoverlap.config.versions import CoreRules
from mbridge_epoverlap.config.violations import Severity, Violation

When = Literal["overlap", "delay_wgrad", "always"]

OVERLAP_KEY = "comm_overlap.overlap_moe_expert_parallel_comm"
DELAY_KEY = "comm_overlap.delay_wgrad_compute"


@dataclass(frozen=True)
class RuleContext:
    """Resolved inputs of the rules: the model config, the effective switches and the environment."""

    model: Any
    overlap: bool
    delay_wgrad: bool
    overlap_grad_reduce: bool
    env: Environment
    core: CoreRules

    def get(self, name: str) -> Any:
        return model_attr(self.model, name)

    def graph_scopes(self) -> set[str]:
        return graph_scope_names(self.get("cuda_graph_scope"))

    def has_shared_expert(self) -> bool:
        return bool(self.get("moe_shared_expert_intermediate_size"))


RuleFn = Callable[[RuleContext], "Violation | None"]


@dataclass(frozen=True)
class Rule:
    """A registered rule."""

    id: str
    when: When
    source: str
    summary: str
    check: RuleFn

    def applies(self, ctx: RuleContext) -> bool:
        if self.when == "overlap":
            return ctx.overlap
        if self.when == "delay_wgrad":
            return ctx.delay_wgrad
        return True


_REGISTRY: dict[str, Rule] = {}


def rule(rule_id: str, when: When, source: str, summary: str) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        if rule_id in _REGISTRY:
            raise RuntimeError(f"rule id {rule_id!r} registered twice")
        _REGISTRY[rule_id] = Rule(rule_id, when, source, summary, fn)
        return fn

    return register


def all_rules() -> list[Rule]:
    """Every rule, in the order they are checked."""
    return list(_REGISTRY.values())


def graph_scope_names(scope: Any) -> set[str]:
    """CUDA-graph scope names from a string ("attn,moe_router"), a list of strings or of enums."""
    if scope is None:
        return set()
    items = scope.split(",") if isinstance(scope, str) else list(scope)
    names = {getattr(item, "name", str(item)).strip() for item in items}
    names.discard("")
    names.discard("full")  # Megatron-Core's old spelling of "the whole layer" (an empty list today)
    return names


def _v(rule_id: str, message: str, fix: str, severity: Severity = "error") -> Violation:
    return Violation(rule_id, message, fix, severity)


# ---- EP overlap (overlap_moe_expert_parallel_comm = True) --------------------------------------------


@rule("ep_size", "overlap", "Megatron-Core", "expert_model_parallel_size > 1")
def _ep_size(ctx: RuleContext) -> Violation | None:
    ep = ctx.get("expert_model_parallel_size") or 1
    if ep > 1:
        return None
    suggestion = largest_divisor(ctx.get("num_moe_experts") or 8, 8, above=1)
    return _v("ep_size", f"EP overlap needs expert parallelism, but expert_model_parallel_size={ep}",
              f"model.expert_model_parallel_size={suggestion} (flag -ep {suggestion}), or {OVERLAP_KEY}=false")


@rule("num_experts", "overlap", "Megatron-Bridge", "num_moe_experts > 1")
def _num_experts(ctx: RuleContext) -> Violation | None:
    experts = ctx.get("num_moe_experts")
    if experts is not None and experts > 1:
        return None
    return _v("num_experts", f"EP overlap needs a MoE model, but num_moe_experts={experts}",
              f"use a MoE recipe (model.num_moe_experts > 1), or {OVERLAP_KEY}=false")


@rule("dispatcher", "overlap", "Megatron-Core", "moe_token_dispatcher_type in {alltoall, flex}")
def _dispatcher(ctx: RuleContext) -> Violation | None:
    dispatcher = ctx.get("moe_token_dispatcher_type")
    if dispatcher in ("alltoall", "flex"):
        return None
    return _v("dispatcher", f"EP overlap needs the alltoall or flex token dispatcher, got {dispatcher!r}",
              "model.moe_token_dispatcher_type=alltoall (or flex with --moe_flex_dispatcher_backend deepep)")


@rule("precision", "overlap", "Megatron-Core", "bf16 or fp16")
def _precision(ctx: RuleContext) -> Violation | None:
    if ctx.get("bf16") or ctx.get("fp16"):
        return None
    return _v("precision", "EP overlap needs a bf16 or fp16 model, but bf16 and fp16 are both False",
              "model.bf16=true (flag -c bf16)")


@rule("torch_version", "overlap", "Megatron-Core", "torch >= 2.6.0 (older torch hangs)")
def _torch_version(ctx: RuleContext) -> Violation | None:
    version = ctx.env.torch_version
    if version is None or version_at_least(version, "2.6.0"):
        return None
    return _v("torch_version", f"EP overlap hangs with torch < 2.6.0; the job has torch {version}",
              "upgrade to torch >= 2.6 (container or venv), or " + f"{OVERLAP_KEY}=false")


@rule("pp_needs_vpp", "overlap", "Megatron-Core",
      "pipeline_model_parallel_size > 1 requires virtual_pipeline_model_parallel_size")
def _pp_needs_vpp(ctx: RuleContext) -> Violation | None:
    pp = ctx.get("pipeline_model_parallel_size") or 1
    if pp <= 1 or ctx.get("virtual_pipeline_model_parallel_size") is not None:
        return None
    layers = ctx.get("num_layers") or 0
    vpp = next((v for v in range(2, 9) if layers and layers % (pp * v) == 0), 2)
    return _v("pp_needs_vpp",
              f"EP overlap with pipeline_model_parallel_size={pp} needs virtual pipeline stages, "
              "but virtual_pipeline_model_parallel_size is None",
              f"model.virtual_pipeline_model_parallel_size={vpp} (flag -vp {vpp}), "
              "or model.pipeline_model_parallel_size=1")


@rule("recompute_full", "overlap", "Megatron-Core", "recompute_granularity != full")
def _recompute_full(ctx: RuleContext) -> Violation | None:
    if ctx.get("recompute_granularity") != "full":
        return None
    return _v("recompute_full", "EP overlap does not work with full activation recompute (recompute_granularity=full)",
              "model.recompute_granularity=selective (or null)")


@rule("recompute_method", "overlap", "Megatron-Core", "recompute_method is None")
def _recompute_method(ctx: RuleContext) -> Violation | None:
    method = ctx.get("recompute_method")
    if method is None:
        return None
    return _v("recompute_method", f"EP overlap needs recompute_method=None, got {method!r}",
              "model.recompute_method=null")


@rule("recompute_layers", "overlap", "Megatron-Core", "recompute_num_layers is None")
def _recompute_layers(ctx: RuleContext) -> Violation | None:
    layers = ctx.get("recompute_num_layers")
    if layers is None:
        return None
    return _v("recompute_layers", f"EP overlap needs recompute_num_layers=None, got {layers}",
              "model.recompute_num_layers=null")


@rule("recompute_moe", "overlap", "Megatron-Core >= 0.17", '"moe" not in recompute_modules')
def _recompute_moe(ctx: RuleContext) -> Violation | None:
    modules = ctx.get("recompute_modules") or []
    if "moe" not in modules:
        return None
    kept = [m for m in modules if m != "moe"]
    fix = f"model.recompute_modules=[{','.join(kept)}]" if kept else "model.recompute_modules=null"
    if ctx.core.rejects_moe_recompute:
        return _v("recompute_moe", 'EP overlap cannot recompute the MoE block ("moe" in recompute_modules)', fix)
    return _v("recompute_moe",
              f'"moe" in recompute_modules defeats EP overlap; Megatron-Core {ctx.core.version} does not reject it, '
              "0.17 and later do", fix, "warning")


@rule("shared_expert_overlap", "overlap", "Megatron-Core", "moe_shared_expert_overlap is False (mutually exclusive)")
def _shared_expert_overlap(ctx: RuleContext) -> Violation | None:
    if not ctx.get("moe_shared_expert_overlap"):
        return None
    return _v("shared_expert_overlap", "EP overlap and moe_shared_expert_overlap are mutually exclusive",
              "model.moe_shared_expert_overlap=false")


@rule("mtp_layers", "overlap", "Megatron-Core",
      "mtp_num_layers in (None, 1) (0 too from 0.19); PP > 1 with 1 on 0.16-0.17")
def _mtp_layers(ctx: RuleContext) -> Violation | None:
    mtp = ctx.get("mtp_num_layers")
    allowed = (None, 0, 1) if ctx.core.mtp_allows_zero else (None, 1)
    pp = ctx.get("pipeline_model_parallel_size") or 1
    if mtp not in allowed:
        choices = ", ".join("null" if a is None else str(a) for a in allowed)
        # One MTP layer needs PP > 1 (below), so without pipeline stages only null passes.
        return _v("mtp_layers",
                  f"EP overlap supports mtp_num_layers in ({choices}) on Megatron-Core {ctx.core.version}, got {mtp}",
                  "model.mtp_num_layers=1 (or null)" if pp > 1 else "model.mtp_num_layers=null")
    if mtp == 1 and pp <= 1:
        message = "EP overlap with an MTP layer needs pipeline_model_parallel_size > 1"
        fix = ("model.pipeline_model_parallel_size=2 model.virtual_pipeline_model_parallel_size=2, "
               "or model.mtp_num_layers=null")
        if ctx.core.mtp_one_needs_pp:
            return _v("mtp_layers", message, fix)
        return _v("mtp_layers", f"{message} on Megatron-Core 0.16-0.17; {ctx.core.version} accepts it", fix, "warning")
    return None


@rule("cuda_graph_moe", "overlap", "Megatron-Core",
      "with transformer_engine CUDA graphs, neither moe nor mlp in cuda_graph_scope")
def _cuda_graph_moe(ctx: RuleContext) -> Violation | None:
    if ctx.get("cuda_graph_impl") != "transformer_engine":
        return None
    bad = sorted(ctx.graph_scopes() & {"moe", "mlp"})
    if not bad:
        return None
    kept = sorted(ctx.graph_scopes() - {"moe", "mlp"}) or ["moe_router", "moe_preprocess"]
    return _v("cuda_graph_moe",
              f"EP overlap cannot run the MoE block inside a CUDA graph (cuda_graph_scope has {bad})",
              f"model.cuda_graph_scope=[{','.join(kept)}] (flag --cuda_graph_scope {','.join(kept)})")


@rule("cuda_graph_local", "overlap", "Megatron-Core",
      "CUDA graphs with EP overlap need cuda_graph_impl=transformer_engine (not local)")
def _cuda_graph_local(ctx: RuleContext) -> Violation | None:
    if ctx.get("cuda_graph_impl") != "local":
        return None
    return _v("cuda_graph_local", "EP overlap does not work with full-iteration (local) CUDA graphs",
              "model.cuda_graph_impl=transformer_engine with a scope such as [attn,moe_router,moe_preprocess], "
              "or model.cuda_graph_impl=none (flag --cuda_graph_impl)")


# ---- Delayed wgrad (delay_wgrad_compute = True) ------------------------------------------------------


@rule("delay_needs_overlap", "delay_wgrad", "Megatron-Core", "delay_wgrad_compute needs EP overlap")
def _delay_needs_overlap(ctx: RuleContext) -> Violation | None:
    if ctx.overlap:
        return None
    return _v("delay_needs_overlap", "delay_wgrad_compute needs overlap_moe_expert_parallel_comm=True",
              f"{OVERLAP_KEY}=true, or {DELAY_KEY}=false")


def _te_text(version: str | None) -> str:
    return f"TE {version}" if version else "no Transformer Engine"


@rule("delay_te_grad_reduce", "delay_wgrad", "Megatron-Bridge", "TE >= 2.7.0 when overlap_grad_reduce is set")
def _delay_te_grad_reduce(ctx: RuleContext) -> Violation | None:
    if not ctx.overlap_grad_reduce or version_at_least(ctx.env.te_version, "2.7.0"):
        return None
    return _v("delay_te_grad_reduce",
              "delay_wgrad_compute with overlap_grad_reduce needs Transformer Engine >= 2.7.0 "
              f"({_te_text(ctx.env.te_version)})",
              "use TE >= 2.7 in the job (give its version with --te_version), or "
              "comm_overlap.overlap_grad_reduce=false ddp.overlap_grad_reduce=false, or " + f"{DELAY_KEY}=false")


@rule("delay_te_grad_accum", "delay_wgrad", "Megatron-Bridge", "TE >= 2.7.0 when gradient_accumulation_fusion")
def _delay_te_grad_accum(ctx: RuleContext) -> Violation | None:
    if not ctx.get("gradient_accumulation_fusion") or version_at_least(ctx.env.te_version, "2.7.0"):
        return None
    return _v("delay_te_grad_accum",
              f"delay_wgrad_compute with gradient_accumulation_fusion needs Transformer Engine >= 2.7.0 "
              f"({_te_text(ctx.env.te_version)})",
              "use TE >= 2.7, or model.gradient_accumulation_fusion=false, or " + f"{DELAY_KEY}=false")


@rule("delay_cuda_graph_te", "delay_wgrad", "Megatron-Core >= 0.16",
      "delay_wgrad with transformer_engine CUDA graphs needs TE >= 2.10.0")
def _delay_cuda_graph_te(ctx: RuleContext) -> Violation | None:
    if ctx.get("cuda_graph_impl") != "transformer_engine" or version_at_least(ctx.env.te_version, "2.10.0"):
        return None
    message = (f"delay_wgrad_compute with cuda_graph_impl=transformer_engine needs Transformer Engine >= 2.10.0 "
               f"({_te_text(ctx.env.te_version)})")
    fix = "use TE >= 2.10, or model.cuda_graph_impl=none, or " + f"{DELAY_KEY}=false"
    if ctx.core.delay_te_graph_needs_te_2_10:
        return _v("delay_cuda_graph_te", message, fix)
    return _v("delay_cuda_graph_te", f"{message}; Megatron-Core {ctx.core.version} does not check it", fix, "warning")


def wgrad_in_graph(ctx: RuleContext) -> bool:
    """Whether a weight gradient is captured in a CUDA graph: attention graphed, or the router graphed
    with a shared expert that is not overlapped (its weights then sit in the graphed region)."""
    if ctx.get("cuda_graph_impl") != "transformer_engine":
        return False
    scopes = ctx.graph_scopes()
    if "attn" in scopes:
        return True
    return "moe_router" in scopes and ctx.has_shared_expert() and not ctx.get("moe_shared_expert_overlap")


@rule("delay_graph_te", "delay_wgrad", "Megatron-Bridge", "wgrad inside a CUDA graph scope needs TE >= 2.12.0")
def _delay_graph_te(ctx: RuleContext) -> Violation | None:
    if not wgrad_in_graph(ctx) or version_at_least(ctx.env.te_version, "2.12.0"):
        return None
    return _v("delay_graph_te",
              f"delay_wgrad_compute with weight gradients inside CUDA graphs (scope {sorted(ctx.graph_scopes())}) "
              f"needs Transformer Engine >= 2.12.0 ({_te_text(ctx.env.te_version)})",
              "use TE >= 2.12, or take attn (and moe_router with a shared expert) out of model.cuda_graph_scope, "
              "or " + f"{DELAY_KEY}=false")


@rule("delay_graph_grad_accum", "delay_wgrad", "Megatron-Bridge",
      "wgrad inside a CUDA graph scope needs gradient_accumulation_fusion")
def _delay_graph_grad_accum(ctx: RuleContext) -> Violation | None:
    if not wgrad_in_graph(ctx) or ctx.get("gradient_accumulation_fusion"):
        return None
    return _v("delay_graph_grad_accum",
              "delay_wgrad_compute with weight gradients inside CUDA graphs needs gradient_accumulation_fusion=True",
              "model.gradient_accumulation_fusion=true")


@rule("delay_graph_attn_bias", "delay_wgrad", "Megatron-Bridge",
      "attn in the graph scope needs add_bias_linear=False and add_qkv_bias=False")
def _delay_graph_attn_bias(ctx: RuleContext) -> Violation | None:
    if ctx.get("cuda_graph_impl") != "transformer_engine" or "attn" not in ctx.graph_scopes():
        return None
    biased = [name for name in ("add_bias_linear", "add_qkv_bias") if ctx.get(name)]
    if not biased:
        return None
    return _v("delay_graph_attn_bias",
              f"delay_wgrad_compute with attention in CUDA graphs does not support biases ({', '.join(biased)}=True)",
              " ".join(f"model.{name}=false" for name in biased) + ", or remove attn from model.cuda_graph_scope")


@rule("delay_legacy_grouped_gemm", "delay_wgrad", "Megatron-Core", "not with moe_use_legacy_grouped_gemm")
def _delay_legacy_grouped_gemm(ctx: RuleContext) -> Violation | None:
    if not ctx.get("moe_use_legacy_grouped_gemm"):
        return None
    return _v("delay_legacy_grouped_gemm", "delay_wgrad_compute does not work with the legacy grouped GEMM",
              "model.moe_use_legacy_grouped_gemm=false")


# ---- Always ------------------------------------------------------------------------------------------


@rule("early_attn_release_needs_overlap", "always", "Megatron-Core",
      "ep_overlap_early_attn_memory_release needs EP overlap")
def _early_attn_release(ctx: RuleContext) -> Violation | None:
    if not ctx.get("ep_overlap_early_attn_memory_release") or ctx.overlap:
        return None
    return _v("early_attn_release_needs_overlap",
              "ep_overlap_early_attn_memory_release needs overlap_moe_expert_parallel_comm=True",
              f"{OVERLAP_KEY}=true, or model.ep_overlap_early_attn_memory_release=false")


@rule("ep_divides_experts", "always", "Megatron-Core", "num_moe_experts divisible by expert_model_parallel_size")
def _ep_divides_experts(ctx: RuleContext) -> Violation | None:
    experts = ctx.get("num_moe_experts")
    ep = ctx.get("expert_model_parallel_size") or 1
    if not experts or experts <= 1 or experts % ep == 0:  # a non-MoE model is num_experts' business
        return None
    suggestion = largest_divisor(experts, ep)
    return _v("ep_divides_experts", f"num_moe_experts={experts} is not divisible by expert_model_parallel_size={ep}",
              f"model.expert_model_parallel_size={suggestion} (flag -ep {suggestion}; a divisor of {experts})")


@rule("flex_backend_gpu", "always", "Megatron-Bridge",
      "the flex dispatcher backend (DeepEP/HybridEP) supports the target GPU")
def _flex_backend_gpu(ctx: RuleContext) -> Violation | None:
    from mbridge_epoverlap.config.flex import flex_backend_problem

    if ctx.get("moe_token_dispatcher_type") != "flex":
        return None
    problem = flex_backend_problem(ctx.get("moe_flex_dispatcher_backend"), ctx.env)
    if problem is None:
        return None
    return _v("flex_backend_gpu", problem,
              "--moe_flex_dispatcher_backend hybridep (Ampere/Hopper/Blackwell incl. GB200), or "
              "model.moe_token_dispatcher_type=alltoall")
