"""Megatron-Bridge's own CUDA-graph rules: which implementation/scope pairs it runs, and the TE RNG tracker.

Megatron-Core checks graphs against EP overlap (`overlap.py`); these are Bridge's checks whatever the
overlap: `utils/cuda_graph.py: validate_cuda_graph_configuration` (in `ConfigContainer.validate`), the
tracker assertion of `GPTModelProvider.provide` (at model build) and the scope checks of the performance
script (`run_script.py`).
"""

from __future__ import annotations

from mbridge_epoverlap.config.model import provide_class
from mbridge_epoverlap.config.rules.registry import RuleContext, rule, violation
from mbridge_epoverlap.config.violations import Violation

_FULL_ITERATION = "full_iteration"


def raw_scope_names(ctx: RuleContext) -> list[str]:
    """Every graph-scope name of both fields, `full_iteration` included (graph_scopes() drops it)."""
    names: list[str] = []
    for value in (ctx.get("cuda_graph_modules"), ctx.get("cuda_graph_scope")):
        if value is None:
            continue
        items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple, set)) \
            else [value]
        names += [str(getattr(item, "name", item)).rsplit(".", 1)[-1].strip() for item in items]
    return [name for name in names if name and name != "full"]


@rule("cuda_graph_local_scoped", "always", "Megatron-Bridge",
      "cuda_graph_impl=local only for the full iteration (scoped graphs are transformer_engine's)",
      symptom="the job stops in Megatron-Bridge's config validation with a `ValueError` (\"Megatron Bridge supports "
              "model.cuda_graph_impl=\\\"local\\\" only for full-iteration CUDA graphs\")",
      cause="Megatron-Bridge builds per-layer graphs with Transformer Engine only; its local graph manager captures "
            "the whole iteration",
      where="`--cuda_graph_impl`, `--cuda_graph_scope`",
      example=("model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn]", "model.use_te_rng_tracker=true"),
      versions="Megatron-Bridge 0.6.x and main (utils/cuda_graph.py)", bridge_enforces=lambda _bridge, _core: True)
def _local_scoped(ctx: RuleContext) -> Violation | None:
    if ctx.get("cuda_graph_impl") != "local" or _FULL_ITERATION in raw_scope_names(ctx):
        return None
    modules = sorted(ctx.graph_scopes())
    return violation("cuda_graph_local_scoped",
                     "Megatron-Bridge runs cuda_graph_impl='local' only for full-iteration graphs"
                     + (f", not for the modules {modules}" if modules else ""),
                     "model.cuda_graph_impl=transformer_engine (flag --cuda_graph_impl transformer_engine), or "
                     "model.cuda_graph_impl=none")


@rule("cuda_graph_full_iteration_mixed", "always", "Megatron-Bridge (performance script)",
      "the full_iteration scope stands alone and not with cuda_graph_impl=transformer_engine",
      symptom="run_script.py stops with a `ValueError` (\"full_iteration CUDA graph scope cannot be combined with "
              "other scopes\")",
      cause="a full-iteration graph already captures every module, and Transformer Engine graphs capture per module",
      where="`--cuda_graph_impl`, `--cuda_graph_scope`",
      example=("model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration,attn]",
               "model.use_te_rng_tracker=true"),
      versions="Megatron-Bridge 0.6.x and main (scripts/performance/utils/overrides.py)")
def _full_iteration_mixed(ctx: RuleContext) -> Violation | None:
    names = raw_scope_names(ctx)
    if _FULL_ITERATION not in names:
        return None
    others = sorted(set(names) - {_FULL_ITERATION})
    if others:
        return violation("cuda_graph_full_iteration_mixed",
                         f"the full_iteration CUDA-graph scope cannot be combined with other scopes ({others})",
                         "model.cuda_graph_scope=[full_iteration] (flag --cuda_graph_scope full_iteration), or "
                         f"model.cuda_graph_scope=[{','.join(others)}] model.cuda_graph_impl=transformer_engine")
    if ctx.get("cuda_graph_impl") == "transformer_engine":
        return violation("cuda_graph_full_iteration_mixed",
                         "the full_iteration CUDA-graph scope does not go with cuda_graph_impl=transformer_engine",
                         "model.cuda_graph_impl=local (flag --cuda_graph_impl local), or "
                         "model.cuda_graph_scope=[attn,moe_router,moe_preprocess]")
    return None


# Megatron-Bridge providers whose own `provide()` builds the model without GPTModelProvider's RNG-tracker assertion
# (Bridge 0.6.2 and main: the hybrid Mamba stack and the Qwen vision-language models, which build their own model
# classes); a provider that defines no `provide()` of its own, or calls GPTModelProvider's, is checked.
PROVIDE_WITHOUT_RNG_CHECK = frozenset({"HybridModelProvider", "MambaModelProvider", "Qwen3VLModelProvider",
                                       "Qwen3VLMoEModelProvider", "Qwen35VLModelProvider", "Qwen35VLMoEModelProvider"})


@rule("cuda_graph_rng_tracker", "always", "Megatron-Bridge (GPTModelProvider.provide, at model build)",
      "any CUDA graph needs the Transformer Engine RNG tracker (use_te_rng_tracker), where GPTModelProvider builds",
      symptom="the config is accepted; the job stops when the model is built with an `AssertionError` "
              "(\"Transformer engine's RNG tracker is required for cudagraphs\")",
      cause="captured graphs replay random-number state, which only Transformer Engine's tracker keeps graph-safe",
      where="`model.use_te_rng_tracker` (run_script.py sets it with --cuda_graph_impl), `--cuda_graph_impl`",
      example=("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn]",
               "model.use_te_rng_tracker=false"),
      versions="Megatron-Bridge 0.6.x and main")
def _rng_tracker(ctx: RuleContext) -> Violation | None:
    impl = ctx.get("cuda_graph_impl")
    if impl in (None, "none") or ctx.get("use_te_rng_tracker"):
        return None
    if provide_class(ctx.model) in PROVIDE_WITHOUT_RNG_CHECK:
        return None
    return violation("cuda_graph_rng_tracker",
                     f"cuda_graph_impl={impl!r} needs the Transformer Engine RNG tracker, but use_te_rng_tracker is "
                     "False", "model.use_te_rng_tracker=true, or model.cuda_graph_impl=none")
