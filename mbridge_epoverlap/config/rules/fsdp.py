"""Megatron-FSDP with EP overlap: what Megatron-Core's FSDP adapter asserts when it wraps the model, and the
Megatron-FSDP v2 contract of Megatron-Bridge main.

`distributed/fsdp/mcore_fsdp_adapter.py` (Megatron-Core 0.18+) checks the v1 rules at model wrap, after the
config was accepted, so nothing stops them before the job has started on its GPUs. The third check there
(with `optim_grads_params`, the FSDP unit modules must be transformer, MoE-transformer or Mamba layers)
holds for the default unit modules, which is all a config can choose.

Megatron-Core main (0.20) adds Megatron-FSDP v2 (`ddp.megatron_fsdp_version=2`, #5865), whose wrapper
(`FullyShardedDataParallelV2._validate_config`) refuses tensor, pipeline and context parallelism, CUDA graphs
and delayed wgrad; Megatron-Bridge main (`training/config.py`, #5395) checks its own stricter v2 contract
in `ConfigContainer.validate` (data parallelism only: no expert parallelism, no MoE model at all). Neither
release's v1 EP-overlap checks apply to v2: it is another wrapper.
"""

from __future__ import annotations

from mbridge_epoverlap.config.rules.registry import OVERLAP_KEY, OVERLAP_ON, RuleContext, rule, violation
from mbridge_epoverlap.config.violations import Violation

_AT_WRAP = "the config is accepted; the job stops when Megatron-FSDP wraps the model, with an `AssertionError`"
_FSDP_ON = ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params")


def _fsdp_v2(ctx: RuleContext) -> bool:
    """Megatron-FSDP v2 wraps the model (Megatron-Core 0.20 with ddp.megatron_fsdp_version=2)."""
    return (bool(ctx.ddp_get("use_megatron_fsdp", False)) and ctx.core.has_fsdp_v2
            and ctx.ddp_get("megatron_fsdp_version", 1) == 2)


def _fsdp(ctx: RuleContext) -> bool:
    """Megatron-FSDP v1 wraps the model, on a release whose wrapper checks EP overlap."""
    return bool(ctx.ddp_get("use_megatron_fsdp", False)) and ctx.core.has_fsdp_overlap_checks and not _fsdp_v2(ctx)


@rule("fsdp_double_buffer", "overlap", "Megatron-Core >= 0.18 (mcore_fsdp_adapter.py, at model wrap)",
      "Megatron-FSDP with EP overlap: no fsdp_double_buffer",
      symptom=f"{_AT_WRAP} (\"1F1B overlap with FSDP does not support double buffer\")",
      cause="the overlapped 1F1B schedule keeps two micro-batches' parameters alive, which the double-buffer "
            "allocator does not provide for",
      where="`--use_megatron_fsdp`, `ddp.fsdp_double_buffer` (some recipes set it)",
      example=(OVERLAP_ON, *_FSDP_ON, "ddp.fsdp_double_buffer=true"), versions="Megatron-Core >= 0.18")
def _double_buffer(ctx: RuleContext) -> Violation | None:
    if not _fsdp(ctx) or not ctx.ddp_get("fsdp_double_buffer", False):
        return None
    return violation("fsdp_double_buffer", "EP overlap with Megatron-FSDP does not support fsdp_double_buffer",
                     f"ddp.fsdp_double_buffer=false, or ddp.use_megatron_fsdp=false, or {OVERLAP_KEY}=false")


@rule("fsdp_cuda_graph", "overlap", "Megatron-Core >= 0.18 (mcore_fsdp_adapter.py, at model wrap)",
      "Megatron-FSDP with EP overlap: cuda_graph_impl none or full_iteration only",
      symptom=f"{_AT_WRAP} (\"1F1B overlap with FSDP does not support per-layer CUDA graphs\")",
      cause="per-layer graphs capture buffers that Megatron-FSDP gathers and frees around each layer",
      where="`--use_megatron_fsdp`, `--cuda_graph_impl`",
      example=(OVERLAP_ON, *_FSDP_ON, "model.cuda_graph_impl=transformer_engine",
               "model.cuda_graph_scope=[attn,moe_router,moe_preprocess]", "model.use_te_rng_tracker=true"),
      versions="Megatron-Core >= 0.18")
def _cuda_graph(ctx: RuleContext) -> Violation | None:
    impl = ctx.get("cuda_graph_impl")
    if not _fsdp(ctx) or impl in ("none", "full_iteration"):
        return None
    return violation("fsdp_cuda_graph",
                     f"EP overlap with Megatron-FSDP does not support per-layer CUDA graphs "
                     f"(cuda_graph_impl={impl!r})",
                     "model.cuda_graph_impl=none (flag --cuda_graph_impl none), or "
                     f"model.cuda_graph_impl=full_iteration, or ddp.use_megatron_fsdp=false, or {OVERLAP_KEY}=false")


_V2_ON = ("ddp.use_megatron_fsdp=true", "ddp.megatron_fsdp_version=2")
_V2_OFF = "ddp.megatron_fsdp_version=1"
_BRIDGE_V2 = "Megatron-Bridge main: training/config.py, #5395"
_CORE_V2 = "Megatron-Core main: distributed/fsdp/mcore_fsdp_adapter.py, #5865"


def _v2_exists(_bridge, core) -> bool:
    return core.has_fsdp_v2


@rule("fsdp_v2_dp_only", "always",
      "Megatron-Bridge main (training/config.py, #5395); Megatron-Core main (mcore_fsdp_adapter.py, #5865, at wrap)",
      "Megatron-FSDP v2: data parallelism only (TP = PP = CP = 1; on Megatron-Bridge main EP = 1 too)",
      symptom="on Megatron-Bridge main its config validation stops with a `ValueError` (\"MFSDP V2 currently supports "
              "DP-only training\"); on 0.6.x the job stops when Megatron-FSDP v2 wraps the model",
      cause="Megatron-FSDP v2 shards parameters over the data-parallel group only; Megatron-Core's wrapper accepts "
            "expert parallelism, Megatron-Bridge main's contract does not yet",
      where="`ddp.megatron_fsdp_version`, `-tp`, `-pp`, `-cp`, `-ep`",
      example=(*_V2_ON, "model.num_moe_experts=null", "model.expert_model_parallel_size=1",
               "model.tensor_model_parallel_size=2"),
      example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Core main (0.20); EP too on Megatron-Bridge main",
      bridge_enforces=lambda bridge, core: bridge.has_fsdp_v2_contract and core.has_fsdp_v2, in_release=_v2_exists)
def _v2_dp_only(ctx: RuleContext) -> Violation | None:
    if not _fsdp_v2(ctx):
        return None
    names = ["tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"]
    if ctx.bridge.has_fsdp_v2_contract:
        names.append("expert_model_parallel_size")
    layout = [f"{name}={ctx.get(name)}" for name in names if (ctx.get(name) or 1) != 1]
    if not layout:
        return None
    where = _BRIDGE_V2 if ctx.bridge.has_fsdp_v2_contract else _CORE_V2
    return violation("fsdp_v2_dp_only",
                     f"Megatron-FSDP v2 supports data parallelism only, but {', '.join(layout)} ({where})",
                     f"{_V2_OFF} (Megatron-FSDP v1), or ddp.use_megatron_fsdp=false")


@rule("fsdp_v2_moe", "always", f"Megatron-Bridge main ({_BRIDGE_V2.split(': ', 1)[1]})",
      "Megatron-FSDP v2 under Megatron-Bridge main: no MoE model (num_moe_experts unset)",
      symptom="Megatron-Bridge main's config validation stops with a `ValueError` (\"MFSDP V2 does not currently "
              "support MoE models.\")",
      cause="Megatron-Bridge main has not wired expert-data-parallel sharding into its v2 path yet; any value of "
            "num_moe_experts counts as MoE",
      where="`ddp.megatron_fsdp_version`, `model.num_moe_experts`, `--bridge-version`",
      example=(*_V2_ON, "model.expert_model_parallel_size=1"), example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Bridge main with Megatron-Core main",
      bridge_enforces=lambda bridge, core: bridge.has_fsdp_v2_contract and core.has_fsdp_v2,
      in_release=lambda bridge, core: bridge.has_fsdp_v2_contract and core.has_fsdp_v2)
def _v2_moe(ctx: RuleContext) -> Violation | None:
    experts = ctx.get("num_moe_experts")
    if not _fsdp_v2(ctx) or experts is None:
        return None
    return violation("fsdp_v2_moe",
                     f"Megatron-FSDP v2 does not support MoE models yet, and num_moe_experts={experts} ({_BRIDGE_V2})",
                     f"{_V2_OFF} (Megatron-FSDP v1 runs EP overlap), or ddp.use_megatron_fsdp=false")


@rule("fsdp_v2_cuda_graph", "always",
      "Megatron-Bridge main (training/config.py, #5395); Megatron-Core main (mcore_fsdp_adapter.py, #5865, at wrap)",
      "Megatron-FSDP v2: no CUDA graphs (cuda_graph_impl=none)",
      symptom="on Megatron-Bridge main its config validation stops with a `ValueError` (\"MFSDP V2 does not support "
              "CUDA graphs.\"); on 0.6.x the job stops when Megatron-FSDP v2 wraps the model",
      cause="Megatron-FSDP v2 gathers and frees parameters in module hooks that a captured graph would freeze",
      where="`ddp.megatron_fsdp_version`, `--cuda_graph_impl`",
      example=(*_V2_ON, "model.num_moe_experts=null", "model.expert_model_parallel_size=1",
               "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn]",
               "model.use_te_rng_tracker=true"),
      example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Core main (0.20)",
      bridge_enforces=lambda bridge, core: bridge.has_fsdp_v2_contract and core.has_fsdp_v2, in_release=_v2_exists)
def _v2_cuda_graph(ctx: RuleContext) -> Violation | None:
    impl = ctx.get("cuda_graph_impl")
    if not _fsdp_v2(ctx) or impl in (None, "none"):
        return None
    where = _BRIDGE_V2 if ctx.bridge.has_fsdp_v2_contract else _CORE_V2
    return violation("fsdp_v2_cuda_graph", f"Megatron-FSDP v2 does not support CUDA graphs (cuda_graph_impl={impl!r}; "
                     f"{where})", f"model.cuda_graph_impl=none (flag --cuda_graph_impl none), or {_V2_OFF}")


@rule("fsdp_v2_delay_wgrad", "delay_wgrad", "Megatron-Core main (mcore_fsdp_adapter.py, #5865, at model wrap)",
      "Megatron-FSDP v2: no delayed wgrad",
      symptom="the job stops when Megatron-FSDP v2 wraps the model (\"MFSDP v2 does not support "
              "delay_wgrad_compute.\"), where the DDP config carries the switch; where it does not (Megatron-Bridge "
              "does not copy comm_overlap.delay_wgrad_compute to it), v2 reduces gradients the delayed wgrad has not "
              "computed yet",
      cause="Megatron-FSDP v2 reduces each gradient as backward produces it; a delayed weight gradient arrives after",
      where="`comm_overlap.delay_wgrad_compute`, `ddp.megatron_fsdp_version`",
      example=(OVERLAP_ON, "comm_overlap.delay_wgrad_compute=true", *_V2_ON),
      example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Core main (0.20)", in_release=_v2_exists)
def _v2_delay_wgrad(ctx: RuleContext) -> Violation | None:
    if not _fsdp_v2(ctx):
        return None
    return violation("fsdp_v2_delay_wgrad",
                     f"Megatron-FSDP v2 does not support delayed wgrad (delay_wgrad_compute=True; {_CORE_V2})",
                     f"comm_overlap.delay_wgrad_compute=false, or {_V2_OFF}")
