"""Rules for EP overlap (`overlap_moe_expert_parallel_comm = True`) and the ones checked always."""

from __future__ import annotations

from mbridge_epoverlap.config.divisors import largest_divisor
from mbridge_epoverlap.config.environment import version_at_least
from mbridge_epoverlap.config.rules.registry import (
    BRIDGE_ASSERT,
    MCORE_ASSERT,
    OVERLAP_KEY,
    OVERLAP_OFF,
    OVERLAP_ON,
    RuleContext,
    rule,
    violation,
)
from mbridge_epoverlap.config.violations import Violation


def _always(_core) -> bool:
    return True


@rule("ep_size", "overlap", "Megatron-Core, Megatron-Bridge", "expert_model_parallel_size > 1",
      symptom=f"{MCORE_ASSERT} about expert_model_parallel_size",
      cause="EP overlap hides the expert all-to-all; with EP = 1 there is none to hide",
      where="`-ep` / `model.expert_model_parallel_size`",
      example=(OVERLAP_ON, "model.expert_model_parallel_size=1"), core_enforces=_always)
def _ep_size(ctx: RuleContext) -> Violation | None:
    ep = ctx.get("expert_model_parallel_size") or 1
    if ep > 1:
        return None
    suggestion = largest_divisor(ctx.get("num_moe_experts") or 8, 8, above=1)
    return violation("ep_size", f"EP overlap needs expert parallelism, but expert_model_parallel_size={ep}",
                     f"model.expert_model_parallel_size={suggestion} (flag -ep {suggestion}), or {OVERLAP_KEY}=false")


@rule("num_experts", "overlap", "Megatron-Bridge", "num_moe_experts > 1",
      symptom=f"{BRIDGE_ASSERT} (num_moe_experts)",
      cause="overlap was switched on for a dense model or a recipe without experts",
      where="`model.num_moe_experts`", example=(OVERLAP_ON, "model.num_moe_experts=1"),
      bridge_enforces=lambda _bridge, _core: True)
def _num_experts(ctx: RuleContext) -> Violation | None:
    experts = ctx.get("num_moe_experts")
    if experts is not None and experts > 1:
        return None
    return violation("num_experts", f"EP overlap needs a MoE model, but num_moe_experts={experts}",
                     f"use a MoE recipe (model.num_moe_experts > 1), or {OVERLAP_KEY}=false")


@rule("dispatcher", "overlap", "Megatron-Core, Megatron-Bridge", "moe_token_dispatcher_type in {alltoall, flex}",
      symptom=f"{MCORE_ASSERT} about moe_token_dispatcher_type",
      cause="only the alltoall and flex dispatchers split dispatch/combine into overlappable stages",
      where="`model.moe_token_dispatcher_type`",
      example=(OVERLAP_ON, "model.moe_token_dispatcher_type=allgather"), core_enforces=_always)
def _dispatcher(ctx: RuleContext) -> Violation | None:
    dispatcher = ctx.get("moe_token_dispatcher_type")
    if dispatcher in ("alltoall", "flex"):
        return None
    return violation("dispatcher", f"EP overlap needs the alltoall or flex token dispatcher, got {dispatcher!r}",
                     "model.moe_token_dispatcher_type=alltoall (or flex with --moe_flex_dispatcher_backend deepep)")


@rule("precision", "overlap", "Megatron-Core, Megatron-Bridge", "bf16 or fp16",
      symptom=f"{MCORE_ASSERT} about bf16/fp16",
      cause="the overlapped schedule is only implemented for bf16 and fp16 models",
      where="`-c` / `model.bf16`, `model.fp16`", example=(OVERLAP_ON, "model.bf16=false"), core_enforces=_always)
def _precision(ctx: RuleContext) -> Violation | None:
    if ctx.get("bf16") or ctx.get("fp16"):
        return None
    return violation("precision", "EP overlap needs a bf16 or fp16 model, but bf16 and fp16 are both False",
                     "model.bf16=true (flag -c bf16)")


@rule("torch_version", "overlap", "Megatron-Core, Megatron-Bridge", "torch >= 2.6.0 (older torch hangs)",
      symptom="the job stops at start-up where Megatron-Core checks the version; where nothing checks it, it hangs "
              "at the first overlapped layer with no error",
      cause="PyTorch before 2.6 deadlocks the overlapped streams",
      where="`python -c 'import torch; print(torch.__version__)'` inside the job's container",
      example=(OVERLAP_ON,), example_versions=(("--torch-version", "2.5.1"),), core_enforces=_always)
def _torch_version(ctx: RuleContext) -> Violation | None:
    version = ctx.env.torch_version
    if version is None or version_at_least(version, "2.6.0"):
        return None
    return violation("torch_version", f"EP overlap hangs with torch < 2.6.0; the job has torch {version}",
                     f"upgrade to torch >= 2.6 (container or venv), or {OVERLAP_KEY}=false")


@rule("pp_needs_vpp", "overlap", "Megatron-Core, Megatron-Bridge",
      "pipeline_model_parallel_size > 1 requires virtual_pipeline_model_parallel_size",
      symptom=f"{MCORE_ASSERT} about virtual_pipeline_model_parallel_size",
      cause="with pipeline parallelism the combined 1F1B schedule is built on the interleaved (virtual) pipeline",
      where="`-pp`, `-vp` / `model.virtual_pipeline_model_parallel_size`",
      example=(OVERLAP_ON, "model.pipeline_model_parallel_size=2", "model.expert_model_parallel_size=8"),
      core_enforces=_always)
def _pp_needs_vpp(ctx: RuleContext) -> Violation | None:
    pp = ctx.get("pipeline_model_parallel_size") or 1
    if pp <= 1 or ctx.get("virtual_pipeline_model_parallel_size") is not None:
        return None
    layers = ctx.get("num_layers") or 0
    vpp = next((v for v in range(2, 9) if layers and layers % (pp * v) == 0), 2)
    return violation("pp_needs_vpp",
                     f"EP overlap with pipeline_model_parallel_size={pp} needs virtual pipeline stages, "
                     "but virtual_pipeline_model_parallel_size is None",
                     f"model.virtual_pipeline_model_parallel_size={vpp} (flag -vp {vpp}), "
                     "or model.pipeline_model_parallel_size=1")


@rule("recompute_full", "overlap", "Megatron-Core, Megatron-Bridge", "recompute_granularity != full",
      symptom=f"{MCORE_ASSERT} about recompute_granularity",
      cause="full recompute re-runs the layer inside backward, which the overlapped schedule cannot split",
      where="`--recompute_granularity` / `model.recompute_granularity`",
      example=(OVERLAP_ON, "model.recompute_granularity=full"), core_enforces=_always)
def _recompute_full(ctx: RuleContext) -> Violation | None:
    if ctx.get("recompute_granularity") != "full":
        return None
    return violation("recompute_full",
                     "EP overlap does not work with full activation recompute (recompute_granularity=full)",
                     "model.recompute_granularity=selective (or null)")


@rule("recompute_method", "overlap", "Megatron-Core, Megatron-Bridge", "recompute_method is None",
      symptom=f"{MCORE_ASSERT} about recompute_method", cause="a recompute method implies whole-layer recompute",
      where="`--recompute_method` / `model.recompute_method`",
      example=(OVERLAP_ON, "model.recompute_method=uniform"), core_enforces=_always)
def _recompute_method(ctx: RuleContext) -> Violation | None:
    method = ctx.get("recompute_method")
    if method is None:
        return None
    return violation("recompute_method", f"EP overlap needs recompute_method=None, got {method!r}",
                     "model.recompute_method=null")


@rule("recompute_layers", "overlap", "Megatron-Core, Megatron-Bridge", "recompute_num_layers is None",
      symptom=f"{MCORE_ASSERT} about recompute_num_layers",
      cause="a recompute layer count implies whole-layer recompute",
      where="`-rl` / `model.recompute_num_layers`", example=(OVERLAP_ON, "model.recompute_num_layers=1"),
      core_enforces=_always)
def _recompute_layers(ctx: RuleContext) -> Violation | None:
    layers = ctx.get("recompute_num_layers")
    if layers is None:
        return None
    return violation("recompute_layers", f"EP overlap needs recompute_num_layers=None, got {layers}",
                     "model.recompute_num_layers=null")


@rule("recompute_moe", "overlap", "Megatron-Bridge; Megatron-Core >= 0.17", '"moe" not in recompute_modules',
      versions="Megatron-Bridge: all releases; Megatron-Core >= 0.17",
      symptom=f"{BRIDGE_ASSERT} (recompute_modules); {MCORE_ASSERT} from Megatron-Core 0.17 on",
      cause="recomputing the MoE block repeats its all-to-alls inside backward",
      where="`--recompute_modules` / `model.recompute_modules`", example=(OVERLAP_ON, "model.recompute_modules=moe"),
      core_enforces=lambda core: core.rejects_moe_recompute,
      bridge_enforces=lambda _bridge, _core: True)
def _recompute_moe(ctx: RuleContext) -> Violation | None:
    modules = ctx.get("recompute_modules") or []
    if "moe" not in modules:
        return None
    kept = [m for m in modules if m != "moe"]
    fix = f"model.recompute_modules=[{','.join(kept)}]" if kept else "model.recompute_modules=null"
    return violation("recompute_moe", 'EP overlap cannot recompute the MoE block ("moe" in recompute_modules)', fix)


@rule("shared_expert_overlap", "overlap", "Megatron-Core, Megatron-Bridge",
      "moe_shared_expert_overlap is False (mutually exclusive)",
      symptom=f"{MCORE_ASSERT} about moe_shared_expert_overlap",
      cause="shared-expert overlap and EP overlap both schedule the shared expert against the all-to-all",
      where="`model.moe_shared_expert_overlap` (a recipe may turn it on)",
      example=(OVERLAP_ON, "model.moe_shared_expert_overlap=true"), core_enforces=_always)
def _shared_expert_overlap(ctx: RuleContext) -> Violation | None:
    if not ctx.get("moe_shared_expert_overlap"):
        return None
    return violation("shared_expert_overlap", "EP overlap and moe_shared_expert_overlap are mutually exclusive",
                     "model.moe_shared_expert_overlap=false")


@rule("mtp_layers", "overlap", "Megatron-Core, Megatron-Bridge",
      "mtp_num_layers in (None, 1), 0 too from core 0.19; PP > 1 with 1 on core 0.16-0.17",
      versions="None or 1 on every Megatron-Core; 0 from 0.19; PP > 1 with 1 on 0.16-0.17",
      symptom=f"{MCORE_ASSERT} about mtp_num_layers (which values pass depends on the Megatron-Core release)",
      cause="the overlapped schedule handles at most one multi-token-prediction layer; 0.16-0.17 also need PP > 1",
      where="`model.mtp_num_layers`, `model.pipeline_model_parallel_size`, `--mcore-version`",
      example=(OVERLAP_ON, "model.mtp_num_layers=2"), core_enforces=_always)
def _mtp_layers(ctx: RuleContext) -> Violation | None:
    mtp = ctx.get("mtp_num_layers")
    allowed = (None, 0, 1) if ctx.core.mtp_allows_zero else (None, 1)
    pp = ctx.get("pipeline_model_parallel_size") or 1
    if mtp not in allowed:
        choices = ", ".join("null" if a is None else str(a) for a in allowed)
        # Where one MTP layer needs PP > 1 (below), only null passes without pipeline stages.
        only_null = pp <= 1 and ctx.core.mtp_one_needs_pp
        fix = "model.mtp_num_layers=null" if only_null else "model.mtp_num_layers=1 (or null)"
        return violation("mtp_layers",
                         f"EP overlap supports mtp_num_layers in ({choices}) on Megatron-Core {ctx.core.version}, "
                         f"got {mtp}", fix)
    if mtp == 1 and pp <= 1 and ctx.core.mtp_one_needs_pp:
        return violation("mtp_layers",
                         f"EP overlap with an MTP layer needs pipeline_model_parallel_size > 1 on Megatron-Core "
                         f"{ctx.core.version} (0.16-0.17)",
                         "model.pipeline_model_parallel_size=2 model.virtual_pipeline_model_parallel_size=2, "
                         "or model.mtp_num_layers=null")
    return None


@rule("cuda_graph_moe", "overlap", "Megatron-Core >= 0.16",
      "with transformer_engine CUDA graphs, neither moe nor mlp in the graph modules",
      versions="Megatron-Core >= 0.16 (0.15: a warning)",
      symptom=f"{MCORE_ASSERT} about the CUDA graph scope (cuda_graph_scope, cuda_graph_modules from 0.18)",
      cause="a CUDA graph around the MoE block freezes the dispatch/compute order the overlap interleaves",
      where="`--cuda_graph_impl`, `--cuda_graph_scope`",
      example=(OVERLAP_ON, "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=moe",
               "model.use_te_rng_tracker=true"),
      core_enforces=lambda core: core.rejects_te_graph_of_moe)
def _cuda_graph_moe(ctx: RuleContext) -> Violation | None:
    if ctx.get("cuda_graph_impl") != "transformer_engine":
        return None
    bad = sorted(ctx.graph_scopes() & {"moe", "mlp"})
    if not bad:
        return None
    kept = sorted(ctx.graph_scopes() - {"moe", "mlp"}) or ["moe_router", "moe_preprocess"]
    if not ctx.core.rejects_te_graph_of_moe:
        return violation("cuda_graph_moe",
                         f"a CUDA graph of {bad} leaves no all-to-all for EP overlap to hide; Megatron-Core "
                         f"{ctx.core.version} does not reject it, 0.16 and later do",
                         f"model.cuda_graph_scope=[{','.join(kept)}] (flag --cuda_graph_scope {','.join(kept)})",
                         "warning")
    return violation("cuda_graph_moe",
                     f"EP overlap cannot run the MoE block inside a CUDA graph (graph modules {bad})",
                     f"model.cuda_graph_scope=[{','.join(kept)}] (flag --cuda_graph_scope {','.join(kept)})")


@rule("cuda_graph_local", "overlap", "Megatron-Core 0.16-0.17",
      "CUDA graphs with EP overlap need cuda_graph_impl=transformer_engine (core 0.16-0.17 only)",
      versions="Megatron-Core 0.16-0.17",
      symptom=f"{MCORE_ASSERT} about cuda_graph_impl (Megatron-Core 0.16-0.17)",
      cause="those releases accept only scoped transformer_engine graphs next to EP overlap; 0.18 lifted it",
      where="`--cuda_graph_impl`, `--mcore-version`",
      example=(OVERLAP_ON, "model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]",
               "model.use_te_rng_tracker=true"), example_versions=(("--mcore-version", "0.17.0"),),
      core_enforces=lambda core: core.graph_impl_must_be_te)
def _cuda_graph_local(ctx: RuleContext) -> Violation | None:
    impl = ctx.get("cuda_graph_impl")
    if impl in ("none", "transformer_engine") or not ctx.core.graph_impl_must_be_te:
        return None
    return violation("cuda_graph_local",
                     f"EP overlap with cuda_graph_impl={impl!r} is rejected by Megatron-Core {ctx.core.version} "
                     "(0.16-0.17 accept only transformer_engine graphs with overlap)",
                     "model.cuda_graph_impl=transformer_engine with a scope such as [attn,moe_router,moe_preprocess], "
                     "or model.cuda_graph_impl=none (flag --cuda_graph_impl), or a job on Megatron-Core >= 0.18")


@rule("cuda_graph_whole_layer", "overlap", "Megatron-Core (transformer_layer.py, at layer build)",
      "a transformer_engine graph of the whole layer (no modules) cannot run with EP overlap",
      symptom="`TransformerConfig` accepts it; the job stops when the first layer is built or replayed, with "
              "\"EP overlap must be disabled when CUDA graph captures the whole MLP/MoE part\"",
      cause="an empty graph scope captures the whole layer, MoE block included, so nothing is left to overlap",
      where="`--cuda_graph_impl`, `--cuda_graph_scope`",
      example=(OVERLAP_ON, "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[]",
               "model.use_te_rng_tracker=true"),
      versions="Megatron-Core >= 0.16 (transformer_layer.py)")
def _cuda_graph_whole_layer(ctx: RuleContext) -> Violation | None:
    if ctx.get("cuda_graph_impl") != "transformer_engine" or ctx.graph_scopes():
        return None
    if not ctx.core.has_whole_layer_graph_check:
        return None  # 0.15's layer has no such assertion
    return violation("cuda_graph_whole_layer",
                     "EP overlap with a transformer_engine CUDA graph of the whole layer (empty graph scope) fails "
                     "when the layer is built: the graph captures the MoE block",
                     "model.cuda_graph_scope=[attn,moe_router,moe_preprocess] (flag --cuda_graph_scope "
                     "attn,moe_router,moe_preprocess), or model.cuda_graph_impl=none")


@rule("cuda_graph_impl_known", "always", "Megatron-Core",
      "cuda_graph_impl in {none, local, transformer_engine}, and full_iteration from core 0.18",
      versions="full_iteration from Megatron-Core 0.18",
      symptom=f"{MCORE_ASSERT} about an invalid cuda graph implementation",
      cause="the full_iteration implementation arrived in Megatron-Core 0.18",
      where="`--cuda_graph_impl`, `--mcore-version`",
      example=("model.cuda_graph_impl=full_iteration", "model.use_te_rng_tracker=true"),
      example_versions=(("--mcore-version", "0.17.0"),), core_enforces=_always)
def _cuda_graph_impl_known(ctx: RuleContext) -> Violation | None:
    impl = ctx.get("cuda_graph_impl")
    known = ["none", "local", "transformer_engine"] + (["full_iteration"] if ctx.core.has_graph_modules else [])
    if impl in known:
        return None
    return violation("cuda_graph_impl_known",
                     f"cuda_graph_impl={impl!r} is not known to Megatron-Core {ctx.core.version} "
                     f"(known: {', '.join(known)})",
                     "model.cuda_graph_impl=local model.cuda_graph_scope=[full_iteration] (releases before 0.18), "
                     "or a job on Megatron-Core >= 0.18")


@rule("early_attn_release_needs_overlap", "always", "Megatron-Core >= 0.16",
      "ep_overlap_early_attn_memory_release needs EP overlap",
      versions="Megatron-Core >= 0.16",
      symptom=f"{MCORE_ASSERT} about ep_overlap_early_attn_memory_release",
      cause="the early attention-memory release is part of the overlapped schedule",
      where="`model.ep_overlap_early_attn_memory_release`",
      example=(OVERLAP_OFF, "model.ep_overlap_early_attn_memory_release=true"),
      core_enforces=lambda core: core.has_early_attn_release)
def _early_attn_release(ctx: RuleContext) -> Violation | None:
    if not ctx.get("ep_overlap_early_attn_memory_release") or ctx.overlap:
        return None
    return violation("early_attn_release_needs_overlap",
                     "ep_overlap_early_attn_memory_release needs overlap_moe_expert_parallel_comm=True",
                     f"{OVERLAP_KEY}=true, or model.ep_overlap_early_attn_memory_release=false")


@rule("dispatch_wgrad_overlap_exclusive", "always", "Megatron-Core >= 0.18",
      "overlap_dispatch_backward_with_experts_wgrad excludes EP overlap and delayed wgrad",
      versions="Megatron-Core >= 0.18",
      symptom=f"{MCORE_ASSERT} about overlap_dispatch_backward_with_experts_wgrad",
      cause="both features reorder the same expert weight-gradient work around the dispatch backward",
      where="`model.overlap_dispatch_backward_with_experts_wgrad`",
      example=(OVERLAP_ON, "model.overlap_dispatch_backward_with_experts_wgrad=true"),
      core_enforces=lambda core: core.has_dispatch_wgrad_overlap)
def _dispatch_wgrad_overlap(ctx: RuleContext) -> Violation | None:
    if not ctx.get("overlap_dispatch_backward_with_experts_wgrad"):
        return None
    clash = [name for name, on in (("overlap_moe_expert_parallel_comm", ctx.overlap),
                                   ("delay_wgrad_compute", ctx.delay_wgrad)) if on]
    if not clash:
        return None
    return violation("dispatch_wgrad_overlap_exclusive",
                     f"overlap_dispatch_backward_with_experts_wgrad cannot be combined with {' and '.join(clash)}",
                     "model.overlap_dispatch_backward_with_experts_wgrad=false, or "
                     + " ".join(f"comm_overlap.{name}=false" for name in clash))


@rule("dispatch_wgrad_overlap_te", "always", "Megatron-Core >= 0.18",
      "overlap_dispatch_backward_with_experts_wgrad needs Transformer Engine >= 2.3.0",
      symptom=f"{MCORE_ASSERT} (\"TE version >= 2.3.0 is required for overlap_dispatch_backward_with_experts_wgrad\")",
      cause="the expert weight-gradient split it overlaps with the dispatch backward arrived in TE 2.3",
      where="`model.overlap_dispatch_backward_with_experts_wgrad`, `--te-version`",
      example=(OVERLAP_OFF, "model.overlap_dispatch_backward_with_experts_wgrad=true"),
      example_versions=(("--te-version", "2.2.0"),), versions="Megatron-Core >= 0.18",
      core_enforces=lambda core: core.has_dispatch_wgrad_overlap)
def _dispatch_wgrad_overlap_te(ctx: RuleContext) -> Violation | None:
    if not ctx.get("overlap_dispatch_backward_with_experts_wgrad") or not ctx.core.has_dispatch_wgrad_overlap:
        return None
    if version_at_least(ctx.env.te_version, "2.3.0"):
        return None
    te = f"TE {ctx.env.te_version}" if ctx.env.te_version else "no Transformer Engine"
    return violation("dispatch_wgrad_overlap_te",
                     f"overlap_dispatch_backward_with_experts_wgrad needs Transformer Engine >= 2.3.0 ({te})",
                     "use TE >= 2.3 in the job (give its version with --te_version), or "
                     "model.overlap_dispatch_backward_with_experts_wgrad=false")


@rule("ep_divides_experts", "always", "Megatron-Core", "num_moe_experts divisible by expert_model_parallel_size",
      symptom=f"{MCORE_ASSERT} about num_moe_experts and the EP size",
      cause="every EP rank must hold the same number of experts",
      where="`-ep`, `model.num_moe_experts`", example=("model.num_moe_experts=120",))
def _ep_divides_experts(ctx: RuleContext) -> Violation | None:
    experts = ctx.get("num_moe_experts")
    ep = ctx.get("expert_model_parallel_size") or 1
    if not experts or experts <= 1 or experts % ep == 0:  # a non-MoE model is num_experts' business
        return None
    suggestion = largest_divisor(experts, ep)
    return violation("ep_divides_experts",
                     f"num_moe_experts={experts} is not divisible by expert_model_parallel_size={ep}",
                     f"model.expert_model_parallel_size={suggestion} (flag -ep {suggestion}; a divisor of {experts})")


@rule("flex_backend_gpu", "always", "Megatron-Bridge",
      "the flex dispatcher backend (DeepEP/HybridEP/NCCL EP) is known to the releases and supports the target GPU",
      symptom="Megatron-Bridge warns and keeps alltoall (no flex, no error), or its validation raises; the run is "
              "slower than expected",
      cause="DeepEP runs on Ampere, Hopper, B200 and B300 only; HybridEP also on GB200/GB300; NCCL EP on Hopper and "
            "Blackwell only, from Megatron-Bridge 0.6 and Megatron-Core 0.19",
      where="`-g`, `--moe_flex_dispatcher_backend`, `--mcore-version`, `--bridge-version`",
      example=("model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=deepep"),
      example_gpu="gb200",
      versions="deepep, hybridep: all releases; ncclep: Megatron-Core >= 0.19 (an error on Megatron-Bridge 0.6.x, a "
               "warning on main, which does not gate it)",
      bridge_enforces=lambda _bridge, _core: True)
def _flex_backend_gpu(ctx: RuleContext) -> Violation | None:
    from mbridge_epoverlap.config.flex import flex_backend_problem

    if ctx.get("moe_token_dispatcher_type") != "flex":
        return None
    backend = ctx.get("moe_flex_dispatcher_backend")
    if backend is None:
        return None  # flex_without_backend says it
    alternatives = ("--moe_flex_dispatcher_backend hybridep (Ampere/Hopper/Blackwell incl. GB200), or "
                    "model.moe_token_dispatcher_type=alltoall model.moe_flex_dispatcher_backend=null")
    if backend == "ncclep" and not ctx.core.has_ncclep:
        return violation("flex_backend_gpu",
                         f"moe_flex_dispatcher_backend='ncclep' needs Megatron-Core >= 0.19 (the job has "
                         f"{ctx.core.version}, which has no NCCL EP dispatcher)",
                         f"{alternatives}, or a job on Megatron-Core >= 0.19")
    problem = flex_backend_problem(backend, ctx.env)
    if problem is None:
        return None
    if backend == "ncclep" and not ctx.bridge.has_ncclep:
        # Megatron-Bridge main does not know ncclep as a backend, so its GPU gate lets the model's ncclep through
        # (training/flex_dispatcher_backend.py at 067f987); NCCL EP itself still runs on Hopper and Blackwell only.
        return violation("flex_backend_gpu", f"{problem}; Megatron-Bridge {ctx.bridge.version} does not check it, so "
                         "the job fails when NCCL EP starts, not before", alternatives, "warning")
    return violation("flex_backend_gpu", problem, alternatives)


@rule("flex_without_backend", "always", "Megatron-Bridge",
      "moe_token_dispatcher_type=flex names a backend (0.6.x crashes without one; main runs alltoall)",
      symptom="Megatron-Bridge 0.6 accepts the config and the job stops when the model is built (\"Invalid backend: "
              "None\"); Megatron-Bridge main switches the dispatcher back to alltoall (#5740)",
      cause="the flex dispatcher needs DeepEP, HybridEP or NCCL EP underneath",
      where="`--moe_flex_dispatcher_backend`, `model.moe_token_dispatcher_type`, `--bridge-version`",
      example=("model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=null"),
      versions="an error on Megatron-Bridge 0.6.x (model build), a warning on main (falls back to alltoall)")
def _flex_without_backend(ctx: RuleContext) -> Violation | None:
    from mbridge_epoverlap.config.flex import FLEX_WITHOUT_BACKEND_CRASHES

    if ctx.get("moe_token_dispatcher_type") != "flex" or ctx.get("moe_flex_dispatcher_backend") is not None:
        return None
    fix = ("--moe_flex_dispatcher_backend deepep (or hybridep), or model.moe_token_dispatcher_type=alltoall")
    if ctx.bridge.flex_none_falls_back:
        return violation("flex_without_backend", "moe_token_dispatcher_type=flex without a backend runs as alltoall "
                         "(Megatron-Bridge main switches it back)", fix, "warning")
    return violation("flex_without_backend", FLEX_WITHOUT_BACKEND_CRASHES, fix)


@rule("ncclep_needs_flex", "always", "Megatron-Core >= 0.19",
      "moe_flex_dispatcher_backend=ncclep only with moe_token_dispatcher_type=flex",
      symptom="Megatron-Core's `TransformerConfig` stops at start-up with a `ValueError` "
              "(\"moe_flex_dispatcher_backend='ncclep' requires moe_token_dispatcher_type='flex'\")",
      cause="the NCCL EP backend is a flex-dispatcher backend; naming it with another dispatcher is a contradiction",
      where="`model.moe_flex_dispatcher_backend`, `model.moe_token_dispatcher_type`",
      example=("model.moe_token_dispatcher_type=alltoall", "model.moe_flex_dispatcher_backend=ncclep"),
      versions="Megatron-Core >= 0.19", core_enforces=lambda core: core.has_ncclep)
def _ncclep_needs_flex(ctx: RuleContext) -> Violation | None:
    if ctx.get("moe_flex_dispatcher_backend") != "ncclep" or ctx.get("moe_token_dispatcher_type") == "flex":
        return None
    if not ctx.core.has_ncclep:
        return None  # older releases ignore the backend of a non-flex dispatcher
    return violation("ncclep_needs_flex",
                     f"moe_flex_dispatcher_backend='ncclep' needs moe_token_dispatcher_type='flex', got "
                     f"{ctx.get('moe_token_dispatcher_type')!r}",
                     "model.moe_token_dispatcher_type=flex (flag --moe_flex_dispatcher_backend ncclep), or "
                     "model.moe_flex_dispatcher_backend=null")


@rule("ncclep_offload_expert_fc1", "overlap", "Megatron-Core >= 0.19",
      "with NCCL EP and EP overlap, no expert_fc1 in offload_modules under fine-grained activation offloading",
      symptom=f"{MCORE_ASSERT} (\"overlap_moe_expert_parallel_comm with ncclep does not support offloading "
              "'expert_fc1'\")",
      cause="offloading expert_fc1 keeps the raw bf16 input of expert FC1, which the overlapped path frees early",
      where="`model.offload_modules`, `model.fine_grained_activation_offloading`, `--moe_flex_dispatcher_backend`",
      example=(OVERLAP_ON, "model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=ncclep",
               "model.fine_grained_activation_offloading=true", "model.offload_modules=[expert_fc1]"),
      versions="Megatron-Core >= 0.19", core_enforces=lambda core: core.has_ncclep)
def _ncclep_offload_expert_fc1(ctx: RuleContext) -> Violation | None:
    if (ctx.get("moe_token_dispatcher_type") != "flex" or ctx.get("moe_flex_dispatcher_backend") != "ncclep"
            or not ctx.core.has_ncclep):
        return None
    modules = list(ctx.get("offload_modules") or [])
    if not ctx.get("fine_grained_activation_offloading") or "expert_fc1" not in modules:
        return None
    kept = [m for m in modules if m != "expert_fc1"]
    return violation("ncclep_offload_expert_fc1",
                     "EP overlap with the ncclep flex backend cannot offload 'expert_fc1' (offload_modules "
                     f"{modules} with fine_grained_activation_offloading)",
                     f"model.offload_modules=[{','.join(kept)}], or model.fine_grained_activation_offloading=false, "
                     f"or {OVERLAP_KEY}=false")


@rule("model_switch_overwritten", "always", "Megatron-Bridge",
      "an EP switch set on the model only is overwritten with False (set it in comm_overlap)",
      symptom="the job runs without the EP overlap or delayed wgrad the model config asked for, and no error says so",
      cause="Megatron-Bridge's comm-overlap set-up starts from off, copies only the comm_overlap.* switches that are "
            "set and writes the result onto the model (training/comm_overlap.py), so an unset comm_overlap switch "
            "means off",
      where="`comm_overlap.overlap_moe_expert_parallel_comm`, `comm_overlap.delay_wgrad_compute`, and the model's "
            "fields of the same names",
      example=(f"{OVERLAP_KEY}=null", "model.overlap_moe_expert_parallel_comm=true"))
def _model_switch_overwritten(ctx: RuleContext) -> Violation | None:
    lost = [name for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute")
            if name in ctx.unset_switches and ctx.get(name)]
    if not lost:
        return None
    return violation("model_switch_overwritten",
                     f"Megatron-Bridge overwrites {', '.join(f'model.{name}=True' for name in lost)} with False: "
                     f"{' and '.join(f'comm_overlap.{name}' for name in lost)} "
                     f"{'is' if len(lost) == 1 else 'are'} unset, which Megatron-Bridge reads as off",
                     " ".join(f"comm_overlap.{name}=true" for name in lost) + ", or "
                     + " ".join(f"model.{name}=false" for name in lost), "warning")
