"""Which Megatron-Core release enforces which EP-overlap rule (read from the release tags).

| rule                                                     | 0.15 | 0.16 | 0.17 | 0.18 | 0.19 |
|----------------------------------------------------------|------|------|------|------|------|
| mtp_num_layers allowed                                   | None, 1 (0 too from 0.19)          |
| mtp_num_layers == 1 needs PP > 1                         | no   | yes  | yes  | no   | no   |
| "moe" in recompute_modules rejected                      | no   | no   | yes  | yes  | yes  |
| delay_wgrad + transformer_engine graphs needs TE >= 2.10 | no   | yes  | yes  | yes  | yes  |

`mcore_version=None` means the newest rules (the last column).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

NEWEST_KNOWN = "0.19"


@dataclass(frozen=True)
class CoreRules:
    """What one Megatron-Core release rejects."""

    version: str
    mtp_allows_zero: bool
    mtp_one_needs_pp: bool
    rejects_moe_recompute: bool
    delay_te_graph_needs_te_2_10: bool


def core_rules(mcore_version: str | None) -> CoreRules:
    """The rule set of the Megatron-Core release `mcore_version` (major.minor matters)."""
    version = Version(mcore_version or NEWEST_KNOWN)
    minor = version.release[:2] if len(version.release) >= 2 else (version.release[0], 0)
    return CoreRules(
        version=f"{minor[0]}.{minor[1]}",
        mtp_allows_zero=minor >= (0, 19),
        mtp_one_needs_pp=(0, 16) <= minor < (0, 18),
        rejects_moe_recompute=minor >= (0, 17),
        delay_te_graph_needs_te_2_10=minor >= (0, 16),
    )
