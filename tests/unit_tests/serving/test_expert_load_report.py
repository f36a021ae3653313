"""Expert-load observability of the batch command: `serve --json` carries the per-layer expert counts the workers
measured (the attention workers' routers and the expert workers that computed them, real processes on the tiny
checkpoint) and, with `--elastic`, the counts of the elastic events."""

from __future__ import annotations

import json

import pytest

from mbridge_epoverlap.serving.model.checkpoint import load_spec

MAX_NEW = 10


def _serve_json(main, capsys, checkpoint, prompts_path, *flags):
    code = main(["serve", "--checkpoint", str(checkpoint), "--prompts", str(prompts_path), "--max-new-tokens",
                 str(MAX_NEW), "--json", *flags])
    assert code == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags", [
    ["--expert-workers", "2"],
    ["--expert-workers", "4", "--elastic", "--redundant-experts", "4", "--rebalance-every", "3",
     "--rebalance-threshold", "1.0"],  # a few prompts' load is within routing noise: rebalance whenever it helps
], ids=["plain", "elastic-rebalancing"])
def test_serve_json_counts_every_routed_token_per_layer(tiny_mixtral_dir, prompts, hf_greedy, tmp_path, capsys,
                                                        flags):
    from mbridge_epoverlap.cli import main

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    result = _serve_json(main, capsys, tiny_mixtral_dir, path, *flags)
    outputs = [c["output_ids"] for c in result["completions"]]
    assert outputs == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    spec = load_spec(tiny_mixtral_dir)
    load = result["expert_load"]
    assert load["layers"] == spec.moe_layer_ids
    # Every token the model ran (each prompt, then each generated token but the last) went to top_k experts
    # in every MoE layer.
    fed = sum(len(p) + len(out) - 1 for p, out in zip(prompts, outputs, strict=True))
    assert [sum(row) for row in load["routed"]] == [fed * spec.top_k] * len(spec.moe_layer_ids)
    assert load["served"] == load["routed"]  # what the expert workers computed is what the routers chose
    for row, ratio in zip(load["routed"], load["max_over_mean"], strict=True):
        assert len(row) == spec.num_experts and ratio == max(row) / (sum(row) / len(row))
    if "--elastic" not in flags:
        assert "elastic" not in result
        return
    elastic = result["elastic"]
    entered = [r for r in elastic["rebalances"] if not r["kept"]]
    assert entered  # the measured load was uneven enough to rebalance
    assert elastic["event_counts"] == {"workers_lost": 0, "rejoined": 0, "rebalances": len(entered),
                                       "moved_copies": sum(r["moved"] for r in entered), "move_fallbacks": 0}
    assert elastic["event_counts"]["moved_copies"] > 0
