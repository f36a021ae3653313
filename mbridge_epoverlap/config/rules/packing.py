"""Native Energon sequence packing and EP overlap (Megatron-Bridge main).

With `dataset.packing_buffer_size` set on an Energon dataset, Megatron-Bridge main's `runtime_config_update`
calls `ConfigContainer._disable_native_energon_packing_moe_overlap` before its comm-overlap set-up
(`training/config.py`, #5285): when EP overlap or delayed wgrad is asked for anywhere (the model, comm_overlap
or the comm-overlap config the user passed), both are written False everywhere, with a Python warning. The
validator therefore checks the rest of the config with both switches off (`CommOverlapConfig.packing_cleared`)
and says so here. Megatron-Bridge 0.6.x has the field but runs packed batches with the switches as set.
"""

from __future__ import annotations

from mbridge_epoverlap.config.rules.registry import DELAY_ON, OVERLAP_ON, RuleContext, rule, violation
from mbridge_epoverlap.config.violations import Violation


@rule("packing_clears_overlap", "always", "Megatron-Bridge main (training/config.py, #5285)",
      "native Energon packing (dataset.packing_buffer_size) runs with EP overlap and delayed wgrad off (a warning)",
      symptom="the job runs without EP overlap and delayed wgrad; Megatron-Bridge warns once (\"Disabling MoE "
              "expert-parallel communication overlap and delayed weight-gradient compute because overlap switches "
              "MCore to combined-1F1B schedule-plan execution ...\") and an A/B of overlap measures off against off",
      cause="overlap runs Megatron-Core's combined-1F1B schedule plan, and the VLM path does not yet forward the "
            "visual inputs or the packed-sequence metadata through that plan",
      where="`dataset.packing_buffer_size`, `--moe_a2a_overlap`, `--delay_wgrad_compute`, `--bridge-version`",
      example=(OVERLAP_ON, DELAY_ON, "dataset.packing_buffer_size=8"),
      example_versions=(("--bridge-version", "main"),),
      versions="Megatron-Bridge main", in_release=lambda bridge, _core: bridge.packing_clears_overlap)
def _packing_clears_overlap(ctx: RuleContext) -> Violation | None:
    if not ctx.packing_cleared:
        return None
    size = ctx.dataset_get("packing_buffer_size")
    return violation("packing_clears_overlap",
                     f"Megatron-Bridge main switches overlap_moe_expert_parallel_comm and delay_wgrad_compute off "
                     f"for native Energon packing (dataset.packing_buffer_size={size}): overlap would run the "
                     "combined-1F1B schedule plan, which does not forward visual inputs or packed-sequence metadata "
                     "(training/config.py, #5285)",
                     "dataset.packing_buffer_size=null (no native packing, keeps EP overlap), or "
                     "comm_overlap.overlap_moe_expert_parallel_comm=false comm_overlap.delay_wgrad_compute=false "
                     "(what will run)", "warning")
