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
| `moe_expert_rank_capacity_factor`, `use_transformer_engine_op_fuser` exist| no | no   | no   | yes  | yes  | yes  |
| NCCL EP: `moe_ncclep_static_shape` picks static shapes (dispatcher init)| no | no  | no   | no   | yes  | no   |
| NCCL EP: the rank capacity factor picks static or eager; no drop-and-pad (#6229)| no | no | no | no | no | yes |
| `moe_dispatch_fwd_dtype` / `moe_combine_bwd_dtype` need ncclep (#6524)| no | no   | no   | no   | no   | yes  |
| `moe_use_grouped_tensor`; ncclep refuses it without the op fuser (#6000)| no | no  | no   | no   | no   | yes  |
| Megatron-FSDP v2 (`ddp.megatron_fsdp_version`; refuses delayed wgrad, graphs) (#5865)| no | no | no | no | no | yes |

Megatron-Bridge adds its own checks on top whatever the core release: `"moe"` in `recompute_modules` and
`mtp_num_layers` in (None, 0, 1) with overlap, the TE 2.7 / 2.12 delayed-wgrad rules. `mcore_version=None`
means the newest rules (the last column).

Megatron-Bridge's own releases differ too (read from the 0.6.2 wheel and main at 067f987, 2026-08-22):

| Megatron-Bridge behaviour                                      | 0.6.x | main |
|----------------------------------------------------------------|-------|------|
| `ncclep` is a flex backend (gated to compute capability 9, 10) | yes   | no   |
| `flex` with backend None falls back to alltoall (#5740)        | no    | yes  |
| native Energon packing switches EP overlap and delayed wgrad off (#5285)| no | yes |
| Megatron-FSDP v2 contract: DP only, no MoE, no CUDA graphs (#5395)| no | yes  |
| no GPU: `apply_flex_dispatcher_backend` sets flex unchecked (#5732)| yes (3 backends) | yes (deepep, hybridep) |

(0.6.x lets flex without a backend through; the job stops at model build with "Invalid backend: None". The
0.6.2 wheel already has main's no-GPU shortcut of #5732, for its three backends.)

`bridge_version=None` means the newest release (0.6); "main" names the main branch (0.7.0 in its
package_info, paired with Megatron-Core main, 0.20.0). Releases this table does not hold are refused
(`check_known_releases`), not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from mbridge_epoverlap.errors import UsageError

NEWEST_KNOWN = "0.20"
NEWEST_BRIDGE = "0.6"
KNOWN_BRIDGE = ("0.6", "main")
KNOWN_RELEASES = ("0.15", "0.16", "0.17", "0.18", "0.19", "0.20")
# The Megatron-Core release Megatron-Bridge main is checked with by default (Megatron-LM main's package_info).
CORE_OF_BRIDGE_MAIN = "0.20"


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
    has_rank_capacity_factor: bool = False
    ncclep_capacity_picks_mode: bool = False
    has_a2a_dtypes: bool = False
    has_grouped_tensor: bool = False
    has_fsdp_v2: bool = False

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
        has_rank_capacity_factor=minor >= (0, 18),
        ncclep_capacity_picks_mode=minor >= (0, 20),
        has_a2a_dtypes=minor >= (0, 20),
        has_grouped_tensor=minor >= (0, 20),
        has_fsdp_v2=minor >= (0, 20),
    )


@dataclass(frozen=True)
class BridgeRules:
    """What one Megatron-Bridge release does differently (see the table above)."""

    version: str
    has_ncclep: bool
    flex_none_falls_back: bool
    packing_clears_overlap: bool = False
    has_fsdp_v2_contract: bool = False

    @property
    def is_main(self) -> bool:
        return self.version == "main"


def bridge_rules(bridge_version: str | None) -> BridgeRules:
    """The behaviour of Megatron-Bridge `bridge_version` ("main", or a release: major.minor matters)."""
    version = bridge_version or NEWEST_BRIDGE
    if version == "main":
        return BridgeRules("main", has_ncclep=False, flex_none_falls_back=True, packing_clears_overlap=True,
                           has_fsdp_v2_contract=True)
    minor = _minor(version)
    return BridgeRules(f"{minor[0]}.{minor[1]}", has_ncclep=minor >= (0, 6), flex_none_falls_back=False)


def bridge_release_of(version: str | None) -> str | None:
    """An installed Megatron-Bridge version as a release name: a version above the newest release is main's
    development version (main says 0.7.0 in its package_info), so it means "main"."""
    if version is None or version == "main":
        return version
    try:
        return "main" if _minor(version) > _minor(NEWEST_BRIDGE) else version
    except InvalidVersion:
        return version


def installed_bridge_release() -> str | None:
    """The release of the Megatron-Bridge installed here ("main" for main's development version), from package
    metadata (not imported), or None."""
    from importlib import metadata

    for dist in ("megatron-bridge", "megatron_bridge"):
        try:
            return bridge_release_of(metadata.version(dist).split("+")[0])
        except metadata.PackageNotFoundError:
            continue
    return None


def _release_name(version: str) -> str | None:
    """The release a version belongs to ("0.19" for "0.19.2"), or None for text that is not a version."""
    try:
        major, minor = _minor(version)
    except InvalidVersion:
        return None
    return f"{major}.{minor}"


def known_core(version: str) -> bool:
    """Whether the validator holds the rules of Megatron-Core `version`."""
    return _release_name(version) in KNOWN_RELEASES


def known_bridge(version: str) -> bool:
    """Whether the validator holds the behaviour of Megatron-Bridge `version` ("main" or a release)."""
    return version.strip().lower() == "main" or _release_name(version) in KNOWN_BRIDGE


def check_known_releases(mcore_version: str | None, bridge_version: str | None, *, mcore_flag: str = "--mcore-version",
                         bridge_flag: str = "--bridge-version") -> None:
    """Raise UsageError (exit 2) for a release whose rules this validator does not hold, naming the known ones.

    A release outside the tables would otherwise be checked with a neighbour's rules, silently.
    """
    problems = []
    if mcore_version is not None and not known_core(str(mcore_version)):
        problems.append(f"{mcore_flag} {mcore_version}: the validator knows the rules of Megatron-Core "
                        f"{', '.join(KNOWN_RELEASES)} (0.20 is Megatron-LM main); give one of them")
    if bridge_version is not None and not known_bridge(str(bridge_version)):
        hint = " (main's package_info says 0.7.0: use main)" if _release_name(bridge_version) == "0.7" else ""
        known = " and ".join(name if name == "main" else f"{name}.x" for name in KNOWN_BRIDGE)
        problems.append(f"{bridge_flag} {bridge_version}: the validator knows Megatron-Bridge {known}{hint}; "
                        "give one of them")
    if problems:
        raise UsageError("; ".join(problems))

