"""Megatron-FSDP with EP overlap: what Megatron-Core's FSDP adapter asserts when it wraps the model.

`distributed/fsdp/mcore_fsdp_adapter.py` (Megatron-Core 0.18+) checks these at model wrap, after the
config was accepted, so nothing stops them before the job has started on its GPUs. The third check there
(with `optim_grads_params`, the FSDP unit modules must be transformer, MoE-transformer or Mamba layers)
holds for the default unit modules, which is all a config can choose.
"""

from __future__ import annotations

from mbridge_epoverlap.config.rules.registry import OVERLAP_KEY, OVERLAP_ON, RuleContext, rule, violation
from mbridge_epoverlap.config.violations import Violation

_AT_WRAP = "the config is accepted; the job stops when Megatron-FSDP wraps the model, with an `AssertionError`"
_FSDP_ON = ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params")


def _fsdp(ctx: RuleContext) -> bool:
    return bool(ctx.ddp_get("use_megatron_fsdp", False)) and ctx.core.has_fsdp_overlap_checks


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
