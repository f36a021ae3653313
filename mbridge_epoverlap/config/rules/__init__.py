"""Every constraint of EP overlap, delayed wgrad and the run layout, one small function per rule.

Each rule has a stable id, says when it applies, who enforces it (and for which Megatron-Core
releases), documents its symptom, cause and fix, and returns a `Violation` or None. `all_rules()` lists
them for the validator, the docs and the CLI; `evaluate` runs them.
"""

from __future__ import annotations

from mbridge_epoverlap.config.rules import (  # noqa: F401  (registers)
    cuda_graphs,
    delay_wgrad,
    flex_backends,
    fsdp,
    layer_kinds,
    layout,
    overlap,
    packing,
)
from mbridge_epoverlap.config.rules.delay_wgrad import wgrad_in_graph
from mbridge_epoverlap.config.rules.layout import data_parallel_size, global_batch_problem
from mbridge_epoverlap.config.rules.registry import (
    Rule,
    RuleContext,
    RunShape,
    graph_module_names,
    graph_scope_names,
    registered_rules,
)
from mbridge_epoverlap.config.violations import Violation

_ORDER = {"overlap": 0, "delay_wgrad": 1, "always": 2, "layout": 3}


def all_rules() -> list[Rule]:
    """Every rule, in the order they are checked: EP overlap, delayed wgrad, always, layout."""
    return sorted(registered_rules(), key=lambda r: _ORDER[r.when])


def evaluate(ctx: RuleContext) -> list[Violation]:
    """Every violated rule that applies to `ctx`, in rule order."""
    found = []
    for registered in all_rules():
        if registered.applies(ctx):
            problem = registered.check(ctx)
            if problem is not None:
                found.append(problem)
    return found


__all__ = [
    "Rule",
    "RuleContext",
    "RunShape",
    "all_rules",
    "data_parallel_size",
    "evaluate",
    "global_batch_problem",
    "graph_module_names",
    "graph_scope_names",
    "wgrad_in_graph",
]
