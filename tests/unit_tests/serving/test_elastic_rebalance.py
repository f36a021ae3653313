"""Rebalancing without a pause: the incremental re-solve, the skip threshold, and epochs switched while streaming.

The solver tests are pure functions; the others run real worker processes on the tiny real checkpoint (the
serving fixtures) and compare every token with transformers' greedy generation.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.elastic.incremental import incremental_slots
from mbridge_epoverlap.serving.elastic.layout import ElasticLayout
from mbridge_epoverlap.serving.elastic.moves import transfers
from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from tests.unit_tests.serving.engine_runs import leftovers as _leftovers
from tests.unit_tests.serving.engine_runs import requests_of as _requests

MAX_NEW = 10


def _moved(old: ElasticLayout, new: ElasticLayout) -> int:
    return sum(len(ids) for ids in transfers(old, new).values())


def _no_twin_on_a_worker(layout: ElasticLayout) -> bool:
    per = layout.slots_per_worker
    rows = [layout.slots[w * per:(w + 1) * per] for w in sorted(layout.alive)]
    return all(len(set(row)) == len(row) for row in rows)


def test_incremental_resolve_moves_strictly_fewer_copies_than_from_scratch():
    # 8 experts in 12 slots on 4 workers; expert 0 turns hot. From scratch, the packing puts replicas on whichever
    # worker is lightest, unrelated to where they are; the incremental solve only adds a replica of the hot
    # expert in place of a spare one.
    layout = ElasticLayout.initial(8, 4, 4)
    load = torch.tensor([30, 20, 10, 10, 10, 10, 5, 5])
    scratch = layout.resolved(layout.alive, load)
    incremental = layout.rebalanced(load, scratch.imbalance(load))
    assert incremental.imbalance(load) <= scratch.imbalance(load) + 1e-12 < layout.imbalance(load)
    assert 0 < _moved(layout, incremental) < _moved(layout, scratch)
    assert min(incremental.replica_counts()) >= 1 and _no_twin_on_a_worker(incremental)


def test_incremental_resolve_changes_nothing_when_the_goal_is_met():
    layout = ElasticLayout.initial(8, 4, 4)
    load = torch.tensor([12, 10, 11, 9, 10, 10, 9, 11])
    assert layout.rebalanced(load, layout.imbalance(load)) == layout
    assert incremental_slots(layout.slots, 4, layout.alive, [0.0] * 8, 1.0) == layout.slots  # no load measured


def test_incremental_resolve_leaves_dead_workers_empty_and_is_deterministic():
    layout, _ = ElasticLayout.initial(8, 4, 4).without({1})
    load = torch.tensor([40, 5, 5, 20, 10, 10, 5, 5])
    goal = layout.resolved(layout.alive, load).imbalance(load)
    first, second = layout.rebalanced(load, goal), layout.rebalanced(load, goal)
    assert first == second and first.alive == layout.alive
    assert first.slots[3:6] == (-1, -1, -1) and first.experts_of(1) == []
    assert first.imbalance(load) < layout.imbalance(load)
    assert min(first.replica_counts()) >= 1 and _no_twin_on_a_worker(first)


def _plan(tiny_mixtral_dir, prompts, **elastic):
    spec = load_spec(tiny_mixtral_dir)
    plan = make_plan(spec, _requests(prompts), expert_workers=4, micro_batches=2, max_new_tokens=MAX_NEW,
                     timeout_s=20)
    return make_elastic(plan, redundant=4, **elastic)


def test_rebalancing_while_streaming_keeps_every_token(tiny_mixtral_dir, prompts, hf_greedy):
    # Every rebalance that helps is done (threshold 1): the epochs switch between two rounds while the decode
    # steps stream, the old weights serving the micro-batches still in flight.
    plan = _plan(tiny_mixtral_dir, prompts, rebalance_every=2, rebalance_threshold=1.0)
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    elastic = result["elastic"]
    assert elastic["streamed"] is True
    done = [r for r in elastic["rebalances"] if not r["kept"]]
    assert len(done) >= 2, elastic["rebalances"]
    assert all(r["moved"] <= r["moved_from_scratch"] for r in done)
    assert all(r["imbalance_after"] < r["imbalance_before"] for r in done)
    retired = [e for e in elastic["events"] if e["event"] == "retired"]
    assert len(retired) == 4 * len(done)  # every expert worker let its old weights go once per epoch
    assert _leftovers(pids) == ([], [])


def test_a_rebalance_within_the_threshold_moves_nothing(tiny_mixtral_dir, prompts, hf_greedy):
    plan = _plan(tiny_mixtral_dir, prompts, rebalance_every=2, rebalance_threshold=50.0)
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    rebalances = result["elastic"]["rebalances"]
    assert rebalances and all(r["skipped"] and r["kept"] for r in rebalances)
    assert all(1.0 <= r["imbalance_before"] <= 50.0 for r in rebalances)
    assert not [e for e in result["elastic"]["events"] if e["event"] in ("moved", "rebalanced")]
    assert _leftovers(pids) == ([], [])


@pytest.mark.parametrize("threshold", [0.9, float("nan")])
def test_rebalance_threshold_below_one_is_refused(tiny_mixtral_dir, prompts, threshold):
    with pytest.raises(UsageError, match="--rebalance-threshold .* must be >= 1"):
        _plan(tiny_mixtral_dir, prompts, rebalance_every=2, rebalance_threshold=threshold)


def test_elastic_bench_reports_the_rebalance_cost(tiny_mixtral_dir, capsys):
    import json

    from mbridge_epoverlap.cli import main

    code = main(["elastic-bench", "--checkpoint", str(tiny_mixtral_dir), "--expert-workers", "2",
                 "--redundant-experts", "2", "--kill", "0", "--batch", "4", "--steps", "8", "--repeats", "1",
                 "--rebalance-every", "2", "--rebalance-threshold", "1.0", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    nf = report["no_failure"]
    assert report["rebalance_cost_ratio"] == nf["rebalancing_tokens_per_s"][0] / nf["elastic_tokens_per_s"][0]
    assert report["rebalance_cost_ratio_paired"] == report["rebalance_cost_ratio"]  # one round
    rebalancing = nf["rebalancing"]
    assert rebalancing["done"] >= 1 and rebalancing["outputs_match_reference"] is True
    assert rebalancing["done"] + rebalancing["skipped"] + rebalancing["kept"] == rebalancing["considered"]
    assert 0 < rebalancing["moved_copies"] <= rebalancing["moved_copies_from_scratch"]
    assert len(rebalancing["imbalance_before"]) == len(rebalancing["imbalance_after"]) == rebalancing["done"]
    assert len(report["load_average"]["start"]) == 3 and report["layout"]["rebalance_threshold"] == 1.0


def test_elastic_bench_rebalance_threshold_below_one_exits_2(tiny_mixtral_dir, capsys):
    from mbridge_epoverlap.cli import main

    assert main(["elastic-bench", "--checkpoint", str(tiny_mixtral_dir), "--expert-workers", "2",
                 "--redundant-experts", "2", "--kill", "0", "--rebalance-every", "2", "--rebalance-threshold",
                 "0.5"]) == 2
    assert "--rebalance-threshold 0.5 must be >= 1" in capsys.readouterr().err


def test_the_default_threshold_skips_what_random_routing_gives_and_not_a_hot_expert():
    import torch

    from mbridge_epoverlap.serving.elastic.workers import routing_noise

    assert routing_noise(512, 4) == pytest.approx(1 + 3 * (3 / 512) ** 0.5)
    assert routing_noise(100_000, 4) < routing_noise(512, 4) < routing_noise(64, 4)  # longer windows tell more
    assert routing_noise(0, 4) == float("inf") and routing_noise(500, 1) == 1.0
    g = torch.Generator().manual_seed(0)
    workers, pairs = 4, 512
    draws = [torch.bincount(torch.randint(0, workers, (pairs,), generator=g), minlength=workers) for _ in range(400)]
    chance = [float(d.max()) / (pairs / workers) for d in draws]
    assert sum(c <= routing_noise(pairs, workers) for c in chance) >= 396  # chance stays below it (99 %)
    assert sum(c > 1.1 for c in chance) > 100  # where the fixed 1.1 alone would rebalance on noise
    hot = torch.tensor([pairs * 0.4, pairs * 0.2, pairs * 0.2, pairs * 0.2])  # one worker's experts twice as hot
    assert float(hot.max()) / float(hot.mean()) > routing_noise(pairs, workers)


def _group_nodes(layout: ElasticLayout, group_size: int) -> dict[int, set[int]]:
    """{group: the nodes (sets of consecutive workers) holding any replica of its experts}."""
    per, per_node = layout.slots_per_worker, layout.workers // layout.nodes
    out: dict[int, set[int]] = {}
    for slot, expert in enumerate(layout.slots):
        if expert >= 0:
            out.setdefault(expert // group_size, set()).add(slot // per // per_node)
    return out


def test_group_limited_placements_keep_each_group_on_one_node():
    # The tiny GLM-4.5's routing: 8 experts in 4 groups of 2. On 4 workers with 4 redundant slots the placement
    # packs whole groups onto 2 nodes of 2 workers (a replica needs a second worker of its node): every replica
    # of a group's experts on one node, at the start and after a solve from scratch for a skewed load.
    layout = ElasticLayout.initial(8, 4, 4, groups=4)
    assert (layout.groups, layout.nodes) == (4, 2)
    load = torch.tensor([40, 5, 5, 20, 10, 10, 5, 5])
    resolved = layout.resolved(layout.alive, load)
    for placed in (layout, resolved):
        assert all(len(nodes) == 1 for nodes in _group_nodes(placed, 2).values()), placed.slots
        assert _no_twin_on_a_worker(placed) and min(placed.replica_counts()) >= 1
    assert resolved.imbalance(load) < layout.imbalance(load)
    # The grouping travels with every placement derived from it, as every worker must re-solve the same way.
    assert {(p.groups, p.nodes) for p in (resolved, layout.rebalanced(load, 1.0), layout.without({1})[0])} == {(4, 2)}
    survivors, _ = layout.without({1})  # a node short of a worker: the global policy, still every expert
    assert survivors.nodes == 2 and min(survivors.replica_counts()) >= 1 and survivors.experts_of(1) == []
    # Without groups, or where they do not divide over the workers, the global policy as before.
    assert ElasticLayout.initial(8, 4, 4) == ElasticLayout.initial(8, 4, 4, groups=1)
    three = ElasticLayout.initial(12, 4, 4, groups=3)
    assert (three.groups, three.nodes) == (1, 1)


def test_rebalancing_a_group_limited_model_keeps_every_token(tiny_glm4_moe_dir, prompts, hf_greedy):
    # GLM-4.5's group-limited routing on the hierarchical placement, rebalanced while streaming: the tokens are
    # transformers' greedy ones.
    spec = load_spec(tiny_glm4_moe_dir)
    plan = make_plan(spec, _requests(prompts), expert_workers=4, micro_batches=2, max_new_tokens=6, timeout_s=20)
    plan = make_elastic(plan, redundant=4, rebalance_every=2, rebalance_threshold=1.0)
    start = ElasticLayout.initial(spec.num_experts, 4, 4, groups=spec.grouped_routing.n_group)
    assert start.nodes == 2 and tuple(plan.slots) == start.slots
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_glm4_moe_dir, prompts, 6)
    assert [r for r in result["elastic"]["rebalances"] if not r["kept"]], result["elastic"]["rebalances"]
    assert _leftovers(pids) == ([], [])
