"""Which Megatron-Core release enforces which EP-overlap rule (read from the release tags 0.15-0.20).

| rule (`TransformerConfig.__post_init__` unless said)          | 0.15 | 0.16 | 0.17 | 0.18 | 0.19 | 0.20 |
|---------------------------------------------------------------|------|------|------|------|------|------|
| `mtp_num_layers` allowed                                      | None, 1                     || None, 0, 1 ||
| `mtp_num_layers == 1` needs PP > 1                            | no   | yes  | yes  | no   | no   | no   |
| `"moe"` in `recompute_modules` rejected                       | no   | no   | yes  | yes  | yes  | yes  |
| CUDA graphs with overlap: impl must be transformer_engine      | no   | yes  | yes  | no   | no   | no   |
| transformer_engine graph of moe/mlp rejected                   | no   | yes  | yes  | yes  | yes  | yes  |
| delay_wgrad + transformer_engine graphs needs TE >= 2.10       | no   | yes  | yes  | yes  | yes  | yes  |
| delay_wgrad rejects `moe_use_legacy_grouped_gemm`              | yes  | yes  | no   | no   | no   | no   |
| `ep_overlap_early_attn_memory_release` exists (needs overlap)  | no   | yes  | yes  | yes  | yes  | yes  |
| graph scope lives in `cuda_graph_modules`; `full_iteration` impl| no   | no   | no   | yes  | yes  | yes  |
| `overlap_dispatch_backward_with_experts_wgrad` exists (TE >= 2.3)| no   | no   | no   | yes  | yes  | yes  |
| `ncclep` flex backend; needs flex; no `expert_fc1` offload w/ overlap| no | no   | no   | no   | yes  | yes  |
| whole-layer TE graph with overlap fails at layer build          | no   | yes  | yes  | yes  | yes  | yes  |
| Megatron-FSDP + overlap: no double buffer, graphs none/full_iteration (wrap)| no | no | no | yes | yes | yes |

Megatron-Bridge adds its own checks on top whatever the core release: `"moe"` in `recompute_modules` and
`mtp_num_layers` in (None, 0, 1) with overlap, the TE 2.7 / 2.12 delayed-wgrad rules. `mcore_version=None`
means the newest rules (the last column).

Megatron-Bridge's own releases differ too (read from the 0.6.2 wheel and main at 067f987, 2026-08-22):

| Megatron-Bridge behaviour                                      | 0.6.x | main |
|----------------------------------------------------------------|-------|------|
| `ncclep` is a flex backend (gated to compute capability 9, 10) | yes   | no   |
| `flex` with backend None falls back to alltoall (#5740)        | no    | yes  |

(0.6.x lets flex without a backend through; the job stops at model build with "Invalid backend: None".)

`bridge_version=None` means the newest release (0.6); "main" names the main branch.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

NEWEST_KNOWN = "0.20"
NEWEST_BRIDGE = "0.6"
KNOWN_BRIDGE = ("0.6", "main")
KNOWN_RELEASES = ("0.15", "0.16", "0.17", "0.18", "0.19", "0.20")


@dataclass(frozen=True)
class CoreRules:
    """What one Megatron-Core release rejects."""

    version: str
    minor: tuple[int, int]
    mtp_allows_zero: bool
    mtp_one_needs_pp: bool
    rejects_moe_recompute: bool
    graph_impl_must_be_te: bool
    rejects_te_graph_of_moe: bool
    delay_te_graph_needs_te_2_10: bool
    delay_rejects_legacy_grouped_gemm: bool
    has_early_attn_release: bool
    has_graph_modules: bool
    has_dispatch_wgrad_overlap: bool
    has_ncclep: bool = False
    has_whole_layer_graph_check: bool = False
    has_fsdp_overlap_checks: bool = False

    def at_least(self, release: str) -> bool:
        return self.minor >= _minor(release)

    def before(self, release: str) -> bool:
        return self.minor < _minor(release)


def _minor(version: str) -> tuple[int, int]:
    release = Version(version).release
    return (release[0], release[1] if len(release) > 1 else 0)


def core_rules(mcore_version: str | None) -> CoreRules:
    """The rule set of the Megatron-Core release `mcore_version` (major.minor matters)."""
    minor = _minor(mcore_version or NEWEST_KNOWN)
    return CoreRules(
        version=f"{minor[0]}.{minor[1]}",
        minor=minor,
        mtp_allows_zero=minor >= (0, 19),
        mtp_one_needs_pp=(0, 16) <= minor < (0, 18),
        rejects_moe_recompute=minor >= (0, 17),
        graph_impl_must_be_te=(0, 16) <= minor < (0, 18),
        rejects_te_graph_of_moe=minor >= (0, 16),
        delay_te_graph_needs_te_2_10=minor >= (0, 16),
        delay_rejects_legacy_grouped_gemm=minor < (0, 17),
        has_early_attn_release=minor >= (0, 16),
        has_graph_modules=minor >= (0, 18),
        has_dispatch_wgrad_overlap=minor >= (0, 18),
        has_ncclep=minor >= (0, 19),
        has_whole_layer_graph_check=minor >= (0, 16),
        has_fsdp_overlap_checks=minor >= (0, 18),
    )


@dataclass(frozen=True)
class BridgeRules:
    """What one Megatron-Bridge release does differently (see the table above)."""

    version: str
    has_ncclep: bool
    flex_none_falls_back: bool


def bridge_rules(bridge_version: str | None) -> BridgeRules:
    """The behaviour of Megatron-Bridge `bridge_version` ("main", or a release: major.minor matters)."""
    version = bridge_version or NEWEST_BRIDGE
    if version == "main":
        return BridgeRules("main", has_ncclep=False, flex_none_falls_back=True)
    minor = _minor(version)
    return BridgeRules(f"{minor[0]}.{minor[1]}", has_ncclep=minor >= (0, 6), flex_none_falls_back=False)
