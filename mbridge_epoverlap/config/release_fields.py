"""Which release has which field: a setting the job's Megatron-Core or Megatron-Bridge does not have is a usage
error (exit 2) naming the release that brought it (or took it away), not a rule violation.

Megatron-Core 0.20 is not released: it is Megatron-LM main, which only Megatron-Bridge main is built against,
so a field main introduced counts as missing on a Megatron-Bridge 0.6.x job whatever `--mcore-version` says.

A run config carries every field the project knows, for every release, with Megatron-Core's defaults; the
job's libraries have only their own. A field set away from its default for a release that lacks it would stop
the job where the config is built (`TypeError: unexpected keyword argument`, or an attribute Megatron-Bridge
cannot set), so the validator refuses it before anything else, naming the field, the release that introduced
it and the fix. The same table checks the few fields whose values are a closed set.

Read from the release tags of Megatron-LM (core_v0.15.0 ... core_v0.19.0, main = 0.20.0) and Megatron-Bridge
(the 0.6.2 wheel, main at 067f987).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mbridge_epoverlap.config.versions import BridgeRules, CoreRules
from mbridge_epoverlap.errors import UsageError


@dataclass(frozen=True)
class FieldRelease:
    """When a field exists in Megatron-Core.

    Attributes:
        key: the run config's dotted key.
        added: the first Megatron-Core release that has it ("0.20" is Megatron-LM main).
        source: where it is defined, and the pull request for main's fields.
        removed: the first release without it, or None.
        instead: what to use once it is removed.
    """

    key: str
    added: str
    source: str
    removed: str | None = None
    instead: str = ""

    @property
    def main_only(self) -> bool:
        """Added by Megatron-LM main (0.20), so only a Megatron-Bridge main job has it."""
        return self.added == "0.20"

    def exists_in(self, bridge: BridgeRules, core: CoreRules) -> bool:
        if self.main_only and not bridge.is_main:
            return False
        return core.at_least(self.added) and (self.removed is None or core.before(self.removed))


_TC = "transformer/transformer_config.py"
FIELD_RELEASES: tuple[FieldRelease, ...] = (
    FieldRelease("model.moe_hybridep_num_sms", "0.16", _TC),
    FieldRelease("model.moe_expert_rank_capacity_factor", "0.18", _TC),
    FieldRelease("model.use_transformer_engine_op_fuser", "0.18", _TC),
    FieldRelease("model.moe_permute_fusion_into_hybridep", "0.18", _TC),
    FieldRelease("model.moe_ncclep_zero_copy", "0.19", f"{_TC}, #5735"),
    FieldRelease("model.moe_ncclep_static_shape", "0.19", _TC, removed="0.20",  # by #6229
                 instead="model.moe_expert_rank_capacity_factor (set: static shapes; unset: eager mode; #6229)"),
    FieldRelease("model.moe_dispatch_fwd_dtype", "0.20", f"{_TC}, #6524"),
    FieldRelease("model.moe_combine_bwd_dtype", "0.20", f"{_TC}, #6524"),
    FieldRelease("model.moe_use_grouped_tensor", "0.20", f"{_TC}, #6000"),
    FieldRelease("ddp.megatron_fsdp_version", "0.20", "distributed/distributed_data_parallel_config.py, #5865"),
)
# Fields whose Megatron-Core values are a closed set (a Literal or a checked range), with those values.
CHOICES: dict[str, tuple[Any, ...]] = {
    "model.moe_dispatch_fwd_dtype": ("bf16", "mxfp8"),
    "model.moe_combine_bwd_dtype": ("bf16", "mxfp8"),
    "ddp.megatron_fsdp_version": (1, 2),
}


def _default(cfg: Any, key: str) -> Any:
    """The value the field has in a fresh config of the same type (what "not set" means)."""
    section, name = key.split(".", 1)
    owner = getattr(cfg, section)
    for f in dataclasses.fields(owner):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            return f.default_factory()  # type: ignore[misc]
    raise KeyError(key)


def _value(cfg: Any, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def release_field_problems(cfg: Any, bridge: BridgeRules, core: CoreRules,
                           keys: Iterable[str] | None = None) -> list[str]:
    """Why each field of `cfg` set away from its default cannot reach a job on these releases, and each value
    outside its field's choices.

    Args:
        cfg: a run config.
        bridge, core: the job's Megatron-Bridge and Megatron-Core releases.
        keys: only these dotted keys (the ones the user set); None: every field in the table.
    """
    wanted = None if keys is None else set(keys)
    problems = []
    for entry in FIELD_RELEASES:
        if wanted is not None and entry.key not in wanted:
            continue
        value = _value(cfg, entry.key)
        if value == _default(cfg, entry.key) or entry.exists_in(bridge, core):
            continue
        if entry.main_only and not bridge.is_main:
            problems.append(f"{entry.key}={value!r}: Megatron-Core main (0.20; {entry.source}) introduced it, and "
                            f"only Megatron-Bridge main runs on it; the job has Megatron-Bridge {bridge.version}: "
                            "drop the setting, or give --bridge-version main")
        elif entry.removed is not None and not core.before(entry.removed):
            problems.append(f"{entry.key}={value!r}: Megatron-Core {entry.removed} removed it ({entry.source}); "
                            f"the job has Megatron-Core {core.version}: use {entry.instead}, or a job on "
                            f"Megatron-Core {_before(entry.removed)}")
        else:
            main = " (Megatron-LM main)" if entry.added == "0.20" else ""
            problems.append(f"{entry.key}={value!r}: Megatron-Core {entry.added}{main} introduced it "
                            f"({entry.source}); the job has Megatron-Core {core.version}: drop the setting, or give "
                            f"--mcore-version {entry.added}" + (" (with --bridge-version main)" if main else ""))
    for key, allowed in CHOICES.items():
        if wanted is not None and key not in wanted:
            continue
        value = _value(cfg, key)
        if value not in allowed:
            problems.append(f"{key}={value!r}: must be one of {', '.join(map(repr, allowed))}; e.g. "
                            f"{key}={allowed[0]}")
    return problems


def check_release_fields(cfg: Any, bridge: BridgeRules, core: CoreRules, keys: Iterable[str] | None = None) -> None:
    """Raise UsageError (exit 2) naming every problem `release_field_problems` finds."""
    problems = release_field_problems(cfg, bridge, core, keys)
    if problems:
        raise UsageError("; ".join(problems))


def _before(release: str) -> str:
    major, minor = (int(part) for part in release.split(".")[:2])
    return f"{major}.{minor - 1}"
