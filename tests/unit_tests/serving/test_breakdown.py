"""`engine.breakdown.step_breakdown`: a prefill and decode steps of the engine's arithmetic, timed by part."""

from __future__ import annotations

from mbridge_epoverlap.serving.engine.breakdown import PARTS, step_breakdown
from mbridge_epoverlap.serving.model.checkpoint import load_spec


def test_every_part_is_timed_and_a_shared_expert_only_where_the_model_has_one(tiny_glm4_moe_dir, tiny_mixtral_dir,
                                                                             prompts):
    with_shared = step_breakdown(load_spec(tiny_glm4_moe_dir), prompts, decode_steps=2, threads=1)
    without = step_breakdown(load_spec(tiny_mixtral_dir), prompts, decode_steps=2, threads=1)
    for result in (with_shared, without):
        assert set(result["decode"]["ms"]) == set(PARTS) and result["tokens_per_decode_step"] == len(prompts)
        assert all(result["decode"]["ms"][part] > 0 for part in ("attention", "router", "experts", "sampling"))
    assert with_shared["decode"]["ms"]["shared_expert"] > 0 and with_shared["prefill"]["ms"]["shared_expert"] > 0
    assert without["decode"]["ms"]["shared_expert"] == 0
