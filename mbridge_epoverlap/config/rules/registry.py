"""The rule registry: what a rule is, what it reads, and the list the validator, docs and CLI share.

Each rule carries its own documentation (the constraint, the symptom a job shows when it is broken and
nobody validated first, the cause, where to look, and a reproducer on the default recipe), so the docs
generator and the tests read the rules instead of keeping tables of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mbridge_epoverlap.config.environment import Environment
from mbridge_epoverlap.config.model import model_attr
from mbridge_epoverlap.config.versions import BridgeRules, CoreRules, bridge_rules
from mbridge_epoverlap.config.violations import Severity, Violation
from mbridge_epoverlap.fields import get_field

When = Literal["overlap", "delay_wgrad", "always", "layout"]

OVERLAP_KEY = "comm_overlap.overlap_moe_expert_parallel_comm"
DELAY_KEY = "comm_overlap.delay_wgrad_compute"
OVERLAP_ON = f"{OVERLAP_KEY}=true"
OVERLAP_OFF = f"{OVERLAP_KEY}=false"
DELAY_ON = f"{DELAY_KEY}=true"

MCORE_ASSERT = "Megatron-Core's `TransformerConfig` stops at start-up with an `AssertionError`"
BRIDGE_ASSERT = "the job stops in Megatron-Bridge's config validation"

# Graph-scope spellings that mean "no per-module scope" (whole layer or whole iteration).
_NOT_MODULES = {"full", "full_iteration", "full_iteration_inference", ""}


@dataclass(frozen=True)
class RunShape:
    """The whole-run facts the layout rules read (a model config alone does not carry them)."""

    num_gpus: int
    global_batch_size: int
    micro_batch_size: int


@dataclass(frozen=True)
class RuleContext:
    """Resolved inputs of the rules: the model config, the effective switches, the environment, the run.

    `unset_switches` names the `comm_overlap.*` EP switches the user left unset (None): Megatron-Bridge
    writes False onto the model for them, whatever the model said.
    """

    model: Any
    overlap: bool
    delay_wgrad: bool
    overlap_grad_reduce: bool
    env: Environment
    core: CoreRules
    run: RunShape | None = None
    bridge: BridgeRules = field(default_factory=lambda: bridge_rules(None))
    unset_switches: frozenset[str] = frozenset()
    ddp: Any = None
    dataset: Any = None
    packing_cleared: frozenset[str] = frozenset()

    def get(self, name: str) -> Any:
        return model_attr(self.model, name)

    def ddp_get(self, name: str, default: Any = None) -> Any:
        """A DDP-config setting (Megatron-Core's `DistributedDataParallelConfig` names), or `default`."""
        return default if self.ddp is None else get_field(self.ddp, name, default)

    def dataset_get(self, name: str, default: Any = None) -> Any:
        """A dataset setting (Megatron-Bridge's dataset-config names), or `default`."""
        return default if self.dataset is None else get_field(self.dataset, name, default)

    def graph_scopes(self) -> set[str]:
        """Per-layer CUDA-graph modules, from `cuda_graph_modules` (core >= 0.18) and `cuda_graph_scope`."""
        return graph_module_names(self.model)

    def has_shared_expert(self) -> bool:
        return self.get("moe_shared_expert_intermediate_size") is not None


RuleFn = Callable[[RuleContext], "Violation | None"]
CoreEnforces = Callable[[CoreRules], bool]
BridgeEnforces = Callable[[BridgeRules, CoreRules], bool]
InRelease = Callable[[BridgeRules, CoreRules], bool]


@dataclass(frozen=True)
class Rule:
    """A registered rule and its documentation.

    Attributes:
        id: stable id (what `Violation.rule` says).
        when: "overlap" (EP overlap on), "delay_wgrad" (delayed wgrad on), "always", or "layout" (a whole
            run is validated: GPU count and batch shape known).
        source: who enforces it ("Megatron-Core", "Megatron-Bridge", both, or "mbridge_epoverlap").
        summary: the constraint, one line.
        symptom: what a job shows when the rule is broken and nobody validated first.
        cause: why it happens.
        where: the settings and flags to look at.
        example: dotted overrides on the default recipe that break exactly this rule.
        example_gpu: target GPU of the reproducer.
        example_versions: version flags of the reproducer that differ from the defaults of the docs.
        core_enforces: for a Megatron-Core release, whether its `TransformerConfig` raises this rule's
            error (None: no release does; the rule is Megatron-Bridge's, a layer build's or a launcher's).
        versions: the releases that bring the rule ("all releases" when every modelled one does).
        bridge_enforces: for a Megatron-Bridge and a Megatron-Core release, whether Bridge's config path
            (`CommOverlapConfig` finalize + setup, `validate_flex_dispatcher_backend`, then Core's
            `TransformerConfig`) raises this rule's error on a CPU; None: only `core_enforces` says.
        check: the function returning a `Violation` or None.
        in_release: for a Megatron-Bridge and a Megatron-Core release, whether the rule exists there at all
            (None: in every release); a rule outside the releases checked is not run and not listed.
    """

    id: str
    when: When
    source: str
    summary: str
    symptom: str
    cause: str
    where: str
    example: tuple[str, ...]
    check: RuleFn
    example_gpu: str = "h100"
    example_versions: tuple[tuple[str, str], ...] = ()
    core_enforces: CoreEnforces | None = None
    versions: str = "all releases"
    bridge_enforces: BridgeEnforces | None = None
    in_release: InRelease | None = None

    def exists_in(self, bridge: BridgeRules, core: CoreRules) -> bool:
        return self.in_release is None or self.in_release(bridge, core)

    def applies(self, ctx: RuleContext) -> bool:
        if not self.exists_in(ctx.bridge, ctx.core):
            return False
        if self.when == "overlap":
            return ctx.overlap
        if self.when == "delay_wgrad":
            return ctx.delay_wgrad
        if self.when == "layout":
            return ctx.run is not None
        return True

    def enforced_by_core(self, core: CoreRules) -> bool:
        return self.core_enforces is not None and self.core_enforces(core)

    def enforced_by_bridge(self, bridge: BridgeRules, core: CoreRules) -> bool:
        """Whether Megatron-Bridge's config path (with Core's finalize under it) raises this rule's error."""
        if self.bridge_enforces is not None:
            return self.bridge_enforces(bridge, core)
        return self.enforced_by_core(core)


_REGISTRY: dict[str, Rule] = {}


def rule(rule_id: str, when: When, source: str, summary: str, *, symptom: str, cause: str, where: str,
         example: tuple[str, ...], example_gpu: str = "h100", example_versions: tuple[tuple[str, str], ...] = (),
         core_enforces: CoreEnforces | None = None, versions: str = "all releases",
         bridge_enforces: BridgeEnforces | None = None, in_release: InRelease | None = None
         ) -> Callable[[RuleFn], RuleFn]:
    """Register the decorated function as rule `rule_id` with its documentation."""

    def register(fn: RuleFn) -> RuleFn:
        if rule_id in _REGISTRY:
            raise RuntimeError(f"rule id {rule_id!r} registered twice")
        _REGISTRY[rule_id] = Rule(rule_id, when, source, summary, symptom, cause, where, example, fn,
                                  example_gpu, example_versions, core_enforces, versions, bridge_enforces, in_release)
        return fn

    return register


def registered_rules() -> list[Rule]:
    """Every registered rule, in registration order."""
    return list(_REGISTRY.values())


def violation(rule_id: str, message: str, fix: str, severity: Severity = "error") -> Violation:
    return Violation(rule_id, message, fix, severity)


def graph_scope_names(scope: Any) -> set[str]:
    """CUDA-graph module names from a string ("attn,moe_router"), a list of strings or of enums.

    "full" (the old spelling of "the whole layer"), "full_iteration" and an empty value name no module.
    """
    if scope is None:
        return set()
    items = scope.split(",") if isinstance(scope, str) else list(scope) if isinstance(scope, (list, tuple, set)) \
        else [scope]
    names = {str(getattr(item, "name", item)).rsplit(".", 1)[-1].strip() for item in items}
    return names - _NOT_MODULES


def graph_module_names(model: Any) -> set[str]:
    """The per-layer graph modules of a model config, read from both fields.

    Megatron-Core 0.18 moved the scope from `cuda_graph_scope` to `cuda_graph_modules` (its
    `__post_init__` migrates the old field and clears it), so a real 0.18+ `TransformerConfig` has the
    modules in the new field, and a config written for older releases in the old one.
    """
    modules = graph_scope_names(model.get("cuda_graph_modules") if isinstance(model, dict)
                                else getattr(model, "cuda_graph_modules", None))
    return modules | graph_scope_names(model_attr(model, "cuda_graph_scope"))
