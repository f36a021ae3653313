"""A/B cases: configs that differ only in named switches, each validated and finalized.

`--ab ep_overlap` gives the skill card's three cases (overlap off, on, on + delayed wgrad);
`--ab KEY[,KEY...]` gives a baseline plus one case per boolean key with that key flipped. Every case
is validated for the target before anything is launched; one error anywhere stops the whole run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.overrides import DELAY_FIELD, OVERLAP_FIELD, apply_overrides, parse_override
from mbridge_epoverlap.config.violations import Violation
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.fields import get_path
from mbridge_epoverlap.harness.launch_env import RecipeLaunch, launch_environment
from mbridge_epoverlap.harness.resolve import Resolved, Target

EP_OVERLAP = "ep_overlap"
OVERLAP_KEY = f"comm_overlap.{OVERLAP_FIELD}"
DELAY_KEY = f"comm_overlap.{DELAY_FIELD}"
# (name, EP overlap, delayed wgrad): the skill card's matched A/B and its delayed-wgrad follow-up.
EP_OVERLAP_CASES = (
    ("ep_overlap_off", False, False),
    ("ep_overlap_on", True, False),
    ("ep_overlap_on_delay_wgrad", True, True),
)
SINGLE_CASE = "run"
BASELINE_CASE = "baseline"


@dataclass(frozen=True)
class CaseSpec:
    """A case before resolution: its name and the dotted overrides that make it differ."""

    name: str
    overrides: tuple[str, ...] = ()


@dataclass
class Case:
    """A resolved case: finalized config (its `env_vars` hold the launch environment).

    `changes` are the settings a GPU job changes on the recipe Megatron-Bridge builds: the dotted keys the
    user's flags and overrides set and the ones the case itself sets, and every other recipe value the
    harness's handling of the flags changed (the graph settings `--cuda_graph_impl` implies, say), with their
    values in `cfg`; `recipe_values` holds the recipe's value of each (GPU targets whose recipe is known).
    """

    name: str
    overrides: list[str]
    cfg: RunConfig
    launch_env: dict[str, str] = field(default_factory=dict)
    changes: dict[str, Any] = field(default_factory=dict)
    recipe_values: dict[str, Any] = field(default_factory=dict)


class ValidationFailed(Exception):
    """Some case breaks a rule for the target; carries every error with the cases it occurs in."""

    def __init__(self, target: Target, errors: list[tuple[Violation, list[str]]]):
        self.target = target
        self.errors = errors
        super().__init__(self.report())

    def report(self) -> str:
        lines = [f"{len(self.errors)} configuration error(s) for -g {self.target.gpu} "
                 f"({self.target.env.describe()}); nothing was launched:"]
        for violation, names in self.errors:
            where = f" (case {', '.join(names)})" if names != [SINGLE_CASE] else ""
            lines.append(f"  [{violation.rule}] {violation.message}{where}")
            lines.append(f"      fix: {violation.fix}")
        if not self.target.is_cpu and self.target.env.te_version is None:
            lines.append("  (no --te_version given: the check assumes the job has no Transformer Engine; pass the "
                         "version the cluster runs, e.g. --te_version 2.9)")
        return "\n".join(lines)


def case_specs(ab: str | None, cfg: RunConfig, explicit: set[str]) -> list[CaseSpec]:
    """The cases `--ab` asks for (one unnamed-switch case without --ab).

    Raises:
        UsageError: an A/B whose switch the user also set, an unknown or non-boolean key.
    """
    if ab is None:
        return [CaseSpec(SINGLE_CASE)]
    names = [part.strip() for part in ab.split(",") if part.strip()]
    if not names:
        raise UsageError("--ab needs ep_overlap or a comma-separated list of boolean config keys")
    if EP_OVERLAP in names:
        if len(names) > 1:
            raise UsageError("--ab ep_overlap runs its own three cases; run other switches as a separate --ab")
        clash = sorted({OVERLAP_KEY, DELAY_KEY} & explicit)
        if clash:
            raise UsageError(f"--ab ep_overlap sets {' and '.join(clash)} itself; drop --moe_a2a_overlap/"
                             "--delay_wgrad_compute and those overrides")
        return [CaseSpec(name, (f"{OVERLAP_KEY}={_b(overlap)}", f"{DELAY_KEY}={_b(delay)}"))
                for name, overlap, delay in EP_OVERLAP_CASES]
    specs = [CaseSpec(BASELINE_CASE)]
    leaves = [key.split(".")[-1] for key in names]
    for key in names:
        value = _effective_switch(cfg, key)
        label = key.split(".")[-1] if leaves.count(key.split(".")[-1]) == 1 else key.replace(".", "_")
        specs.append(CaseSpec(f"{label}_{'on' if not value else 'off'}", (f"{key}={_b(not value)}",)))
    if len({s.name for s in specs}) != len(specs):
        raise UsageError(f"--ab {ab}: a key is listed twice")
    return specs


def _b(value: bool) -> str:
    return "true" if value else "false"


def _require_switch(cfg: RunConfig, key: str) -> None:
    """--ab flips switches: a key that holds a number, text or list is named as not a switch."""
    from mbridge_epoverlap.config.overrides import resolve_key

    try:
        _, _, annotation = resolve_key(cfg, key)
    except UsageError as exc:
        raise UsageError(f"--ab {key}: {exc} (--ab takes boolean config keys such as model.moe_permute_fusion)") \
            from None
    if annotation is not bool and annotation != (bool | None):
        value = get_path(cfg, key)
        raise UsageError(f"--ab {key}: not a switch (it holds {type(value).__name__} {value!r}); --ab flips "
                         f"true/false keys such as model.moe_permute_fusion; to compare values of {key}, run "
                         f"once per value with {key}=VALUE")


def _effective_switch(cfg: RunConfig, key: str) -> bool:
    """The value a boolean switch has in the run (None in comm_overlap means "as the model/DDP says")."""
    if key.startswith("env_vars."):
        raise UsageError(f"--ab {key}: environment variables are strings, not switches; A/B them with two runs")
    _require_switch(cfg, key)
    probe = cfg.copy()
    try:
        apply_overrides(probe, [f"{key}=true"])
    except UsageError as exc:
        raise UsageError(f"--ab {key}: {exc} (--ab takes boolean config keys such as model.moe_permute_fusion)") \
            from None
    current = get_path(cfg, key)
    if current is None and key == OVERLAP_KEY:
        return cfg.comm_overlap.effective_overlap(cfg.model)
    if current is None and key == DELAY_KEY:
        return cfg.comm_overlap.effective_delay_wgrad(cfg.model)
    if current is None and key == "comm_overlap.overlap_grad_reduce":
        return cfg.comm_overlap.effective_overlap_grad_reduce(cfg.ddp)
    return bool(current)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Mute a library logger whose warnings the harness already prints once, per case group."""
    log = logging.getLogger(name)
    previous, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = previous


def case_of(resolved: Resolved, spec: CaseSpec) -> Case:
    """One case's config and the changes its job makes on the recipe (neither validated nor finalized)."""
    cfg = apply_overrides(resolved.cfg.copy(), spec.overrides)
    keys = set(resolved.explicit) | {parse_override(item)[0] for item in spec.overrides}
    changes, was = _changes(cfg, keys, resolved)
    return Case(spec.name, list(spec.overrides), cfg, changes=changes, recipe_values=was)


def build_cases(resolved: Resolved, specs: list[CaseSpec]) -> tuple[list[Case], list[str]]:
    """Apply, validate and finalize every case; return the cases and warnings (each once).

    Raises:
        ValidationFailed: any case breaks a rule for the target (nothing has been launched).
    """
    errors: dict[Violation, list[str]] = {}
    warnings: dict[str, list[str]] = {}
    cases = []
    for spec in specs:
        case = case_of(resolved, spec)
        for violation in case.cfg.validate(resolved.target.env):
            if violation.severity == "error":
                errors.setdefault(violation, []).append(spec.name)
            else:
                text = f"[{violation.rule}] {violation.message} (fix: {violation.fix})"
                warnings.setdefault(text, []).append(spec.name)
        cases.append(case)
    if errors:
        raise ValidationFailed(resolved.target, list(errors.items()))
    for spec, case in zip(specs, cases, strict=True):
        with _quiet("mbridge_epoverlap.config.comm_overlap"):
            case.cfg.comm_overlap.finalize(case.cfg.model, case.cfg.ddp, resolved.target.env, case.cfg.dataset)
        env, env_warnings = launch_environment(case.cfg, resolved.target.gpu, recipe=_recipe_launch(resolved),
                                               reconnect=_reconnects(resolved, spec),
                                               overlap_set=_overlap_set(resolved, spec))
        case.cfg.env_vars = dict(env)
        case.launch_env = dict(env)
        for text in env_warnings:
            warnings.setdefault(text, []).append(case.name)
    return cases, [_with_cases(text, names, len(specs)) for text, names in warnings.items()]


def _changes(cfg: RunConfig, keys: set[str], resolved: Resolved) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings the job writes on its recipe, and the recipe's value of each (GPU targets with a recipe)."""
    from mbridge_epoverlap.harness.recipe_facts import fact_keys

    recipe = resolved.recipe
    if recipe is not None:
        keys = keys | {key for key in fact_keys() if get_path(cfg, key) != get_path(recipe, key)}
    changes = {key: get_path(cfg, key) for key in sorted(keys)}
    was = {key: get_path(recipe, key) for key in changes if recipe is not None and _has_path(recipe, key)}
    return changes, was


def _has_path(cfg: RunConfig, key: str) -> bool:
    try:
        get_path(cfg, key)
    except (AttributeError, KeyError):
        return False
    return True


def _recipe_launch(resolved: Resolved) -> RecipeLaunch | None:
    """What the recipe brings to the launch environment (GPU targets), as `run_script.py` reads it before any
    override: its env_vars, its flex backend and its comm_overlap EP switch."""
    if resolved.recipe is None:
        return None
    env = resolved.upstream.env_vars if resolved.upstream is not None else {}
    return RecipeLaunch(env, resolved.recipe.model.moe_flex_dispatcher_backend,
                        bool(resolved.recipe.comm_overlap.overlap_moe_expert_parallel_comm))


# Flags after which Megatron-Bridge's run_script.py recomputes CUDA_DEVICE_MAX_CONNECTIONS (-tp, -cp,
# --moe_a2a_overlap), by the key each sets.
RECONNECT_KEYS = frozenset({"model.tensor_model_parallel_size", "model.context_parallel_size", OVERLAP_KEY})


def _reconnects(resolved: Resolved, spec: CaseSpec) -> bool:
    """Whether the case's connection count is recomputed: -tp, -cp or --moe_a2a_overlap given, or the case
    switching EP overlap itself (what --moe_a2a_overlap true/false does for one run upstream)."""
    case_keys = {parse_override(item)[0] for item in spec.overrides}
    return bool(RECONNECT_KEYS & resolved.flag_keys) or OVERLAP_KEY in case_keys


def _overlap_set(resolved: Resolved, spec: CaseSpec) -> bool:
    """Whether --moe_a2a_overlap or the case itself set the EP overlap switch (else the recipe's counts)."""
    return OVERLAP_KEY in resolved.flag_keys or OVERLAP_KEY in {parse_override(item)[0] for item in spec.overrides}


def _with_cases(text: str, names: list[str], total: int) -> str:
    return text if len(names) == total else f"{text} (case {', '.join(names)})"


def same_except_switches(cases: list[Case]) -> list[str]:
    """Dotted keys that differ between cases beyond their overrides (should be none; for a sanity check)."""
    if len(cases) < 2:
        return []
    switched = {item.split("=", 1)[0] for case in cases for item in case.overrides}
    switched |= {f"model.{OVERLAP_FIELD}", f"model.{DELAY_FIELD}"}
    base = _flat(cases[0].cfg)
    differing = set()
    for case in cases[1:]:
        other = _flat(case.cfg)
        differing |= {k for k in base.keys() | other.keys() if base.get(k) != other.get(k)}
    return sorted(k for k in differing - switched if not k.startswith("env_vars."))


def _flat(cfg: RunConfig) -> dict[str, object]:
    out: dict[str, object] = {}

    def walk(obj: object, prefix: str) -> None:
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = repr(value)

    walk(cfg, "")
    return out
