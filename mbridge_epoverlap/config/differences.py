"""The deliberate differences from Megatron-Bridge, one row each; anything else that differs is a bug.

Every row holds for Megatron-Bridge 0.6.2 and for main (067f987, 2026-08-22); `open_pr` names the open
upstream pull request that would change the row, where there is one.

The docs generator writes them as the "Differences from Megatron-Bridge" table of the skill card and the
training doc; the tests check that each row's behaviour is what the row says.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Difference:
    """One deliberate difference.

    Attributes:
        topic: the flag, setting or function concerned.
        upstream: what Megatron-Bridge does.
        ours: what this project does.
        why: the reason.
        open_pr: the open Megatron-Bridge pull request that would change the row ("" when none).
    """

    topic: str
    upstream: str
    ours: str
    why: str
    open_pr: str = ""


DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        "`--moe_a2a_overlap false`",
        "does nothing: overlap stays as the recipe set it (Megatron-Bridge #6006)",
        "sets `comm_overlap.overlap_moe_expert_parallel_comm=false`: overlap is really off",
        "an A/B needs a baseline with overlap off; a flag that cannot switch it off measures on against on",
        "#6090 (`--moe_a2a_overlap false` switches overlap off)"),
    Difference(
        "`--moe_a2a_overlap true`",
        "sets overlap, delayed wgrad and `moe_shared_expert_overlap=False` together",
        "sets overlap only; delayed wgrad is `--delay_wgrad_compute true` (its own A/B case)",
        "the gain of overlap and the gain of delayed wgrad are measured separately"),
    Difference(
        "a flag and a dotted override that disagree (e.g. `-ep 4 model.expert_model_parallel_size=8`)",
        "both are applied in a fixed order and the later one wins silently",
        "an error naming both settings (exit 2)",
        "a run must not measure a configuration the user did not mean"),
    Difference(
        "an explicit flex backend on a GPU that cannot run it (e.g. `--moe_flex_dispatcher_backend deepep -g gb200`)",
        "warns on rank 0 and falls back to alltoall (Megatron-Bridge #5992)",
        "the harness stops with a validation error naming the GPU and `hybridep`; the library call "
        "`apply_flex_dispatcher_backend` (non-strict) still warns and falls back as upstream does",
        "a silent fallback makes a flex A/B measure alltoall",
        "#6150 (the flex fallbacks)"),
    Difference(
        "the launcher",
        "NeMo-Run (Slurm or Kubeflow executor), in the `nvcr.io/nvidia/nemo:dev` container unless `-i` names another; "
        "`--detach` defaults to true",
        "an sbatch script (or local processes for `-g cpu`); a container only with `-i`; NeMo-Run and Kubeflow "
        "settings are accepted and recorded in the script (the dry run shows where each flag went); `--detach` "
        "defaults to false",
        "the harness follows the job to report the A/B table; one script a user can read and resubmit"),
    Difference(
        "`-c/--compute_dtype` absent",
        "bf16",
        "the recipe's precision for the run config; bf16 for the Megatron-Bridge recipe lookup, as upstream",
        "a flag that is absent keeps the recipe's value, like every other flag here"),
    Difference(
        "validation of the overlap settings",
        "stops at the first failed assertion (`AssertionError`)",
        "reports every violated rule at once with a fix (`ConfigValidationError`, a `ValueError`); the same "
        "configurations are accepted and rejected as by Bridge's config validation with Megatron-Core's under it "
        "(2000-configuration differentials against 0.6.2 and against main: 0 missed, 0 false rejections), and the "
        "checks Bridge and Core make only at model build or wrap (`cuda_graph_whole_layer`, `cuda_graph_rng_tracker`, "
        "`fsdp_*`, `ncclep_*`, `flex_without_backend`) are made before launch too",
        "one run shows every problem and its fix; the rules are Bridge's own (which Megatron-Bridge #4971 "
        "aligned with Megatron-Core's)"),
)
