"""Expert placement (EPLB): shapes, invariants, determinism, balance on skewed loads, survivors."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.elastic import eplb


def check_placement(placement: eplb.ReplicaMaps, num_logical: int, num_replicas: int, num_gpus: int,
                    alive: list[int] | None = None) -> None:
    phy2log, log2phy, logcnt = placement
    layers = phy2log.shape[0]
    assert phy2log.shape == (layers, num_replicas)
    assert logcnt.shape == (layers, num_logical)
    assert log2phy.shape[:2] == (layers, num_logical) and log2phy.shape[2] == int(logcnt.max())
    alive = list(range(num_gpus)) if alive is None else alive
    per_gpu = num_replicas // num_gpus
    for layer in range(layers):
        assert (logcnt[layer] >= 1).all(), "every logical expert keeps at least one replica"
        for gpu in range(num_gpus):
            slots = phy2log[layer, gpu * per_gpu:(gpu + 1) * per_gpu]
            if gpu in alive:
                assert (slots >= 0).all(), f"live GPU {gpu} has all {per_gpu} slots filled"
            else:
                assert (slots == eplb.EMPTY_SLOT).all(), f"dead GPU {gpu} holds nothing"
        for expert in range(num_logical):
            count = int(logcnt[layer, expert])
            slots = log2phy[layer, expert]
            assert (slots[count:] == eplb.EMPTY_SLOT).all()
            assert slots[:count].tolist() == sorted(slots[:count].tolist())
            assert (phy2log[layer, slots[:count]] == expert).all(), "log2phy inverts phy2log"
        assert int(logcnt[layer].sum()) == int((phy2log[layer] >= 0).sum())


@pytest.mark.parametrize(("layers", "experts", "replicas", "groups", "nodes", "gpus"), [
    (3, 16, 16, 1, 1, 4),    # no redundancy
    (2, 16, 20, 4, 2, 4),    # hierarchical: 4 groups on 2 nodes
    (2, 16, 24, 1, 1, 8),    # global, 3 slots per GPU
    (4, 64, 72, 8, 2, 8),    # hierarchical, DeepSeek-like proportions
    (2, 12, 16, 3, 2, 4),    # groups do not divide by nodes: global
])
def test_shapes_and_invariants(layers: int, experts: int, replicas: int, groups: int, nodes: int, gpus: int) -> None:
    load = eplb.zipf_load(layers, experts, seed=layers + experts)
    placement = eplb.rebalance_experts(load, replicas, groups, nodes, gpus)
    check_placement(placement, experts, replicas, gpus)
    assert placement.phy2log.dtype == torch.long


def test_deterministic_and_ties_resolved_the_same_way() -> None:
    load = torch.ones(3, 32)  # all ties
    first = eplb.rebalance_experts(load, 40, 4, 2, 8)
    for _ in range(3):
        again = eplb.rebalance_experts(load.clone(), 40, 4, 2, 8)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    skewed = eplb.zipf_load(2, 32, seed=7)
    assert torch.equal(eplb.rebalance_experts(skewed, 48, 1, 1, 8).phy2log,
                       eplb.rebalance_experts(skewed.float(), 48, 1, 1, 8).phy2log), "dtype does not matter"


def test_another_process_with_other_thread_settings_gets_the_same_maps() -> None:
    """Survivors compute the placement independently; it must not depend on the process or its threads."""
    script = ("import hashlib, sys, torch\n"
              "from mbridge_epoverlap.serving.elastic import eplb\n"
              "torch.set_num_threads(int(sys.argv[1]))\n"
              "load = eplb.zipf_load(6, 64, seed=9)\n"
              "p = eplb.rebalance_over_survivors(load, 96, 16, [g for g in range(16) if g != 5], 8, 2)\n"
              "print(hashlib.sha256(b''.join(t.numpy().tobytes() for t in p)).hexdigest())\n")
    other = subprocess.run([sys.executable, "-c", script, "1"], capture_output=True, text=True, check=True,
                           timeout=120).stdout.strip()
    load = eplb.zipf_load(6, 64, seed=9)
    here = eplb.rebalance_over_survivors(load, 96, 16, [g for g in range(16) if g != 5], 8, 2)
    assert other == hashlib.sha256(b"".join(t.numpy().tobytes() for t in here)).hexdigest()


def test_heavy_experts_get_the_extra_replicas() -> None:
    load = torch.tensor([[100.0, 1, 1, 1, 1, 1, 1, 1]])
    placement = eplb.rebalance_experts(load, 12, 1, 1, 4)
    assert placement.logcnt[0].tolist() == [5, 1, 1, 1, 1, 1, 1, 1]
    # Its 5 replicas carry 20 each; 5 over 4 GPUs puts two on one GPU, whose third slot takes a light expert.
    loads = eplb.gpu_loads(load, placement.phy2log, 4)[0]
    assert sorted(loads.tolist()) == [22.0, 22.0, 22.0, 41.0]


def test_hierarchical_keeps_each_group_on_one_node() -> None:
    load = eplb.zipf_load(2, 32, seed=3)
    num_gpus, nodes, groups = 8, 2, 4
    phy2log = eplb.rebalance_experts(load, 48, groups, nodes, num_gpus).phy2log
    slots_per_node = 48 // nodes
    for layer in range(2):
        for node in range(nodes):
            experts = phy2log[layer, node * slots_per_node:(node + 1) * slots_per_node]
            assert len(set((experts // (32 // groups)).tolist())) == groups // nodes


@pytest.mark.parametrize(("experts", "gpus", "redundant"), [(64, 8, 8), (128, 16, 32), (256, 32, 32)])
def test_zipf_balance_beats_greedy_baseline_and_no_rebalancing(experts: int, gpus: int, redundant: int) -> None:
    load = eplb.zipf_load(4, experts, seed=experts)
    replicas = experts + redundant
    none = eplb.imbalance(load, eplb.contiguous_placement(4, experts), gpus).mean()
    greedy = eplb.imbalance(load, eplb.greedy_placement(load, replicas, gpus), gpus).mean()
    ours = eplb.imbalance(load, eplb.rebalance_experts(load, replicas, 1, 1, gpus).phy2log, gpus).mean()
    assert ours <= greedy + 1e-9, f"EPLB {ours:.3f} vs greedy {greedy:.3f}"
    assert ours < 1 + 0.5 * (none - 1), f"EPLB {ours:.3f} should remove most of the imbalance of {none:.3f}"
    assert ours < 1.15


def test_survivors_keep_every_expert_and_leave_dead_slots_empty() -> None:
    load = eplb.zipf_load(3, 16, seed=11)
    alive = [0, 2, 3]
    after = eplb.rebalance_over_survivors(load, 24, 4, alive)
    check_placement(after, 16, 24, 4, alive=alive)
    assert eplb.imbalance(load, after.phy2log, 4, alive_gpus=alive).max() < 1.3
    # Tokens never go to the dead GPU.
    ids = torch.randint(0, 16, (500, 2), generator=torch.Generator().manual_seed(0))
    slots = eplb.choose_replicas(ids, torch.arange(500), after.log2phy[0], after.logcnt[0])
    assert not ((slots // 6) == 1).any()
    # The same answer on every survivor, however the alive set is spelled.
    again = eplb.rebalance_over_survivors(load, 24, 4, (3, 0, 2, 2))
    assert torch.equal(after.phy2log, again.phy2log)


def test_survivors_keep_hierarchy_when_nodes_stay_even() -> None:
    load = eplb.zipf_load(2, 32, seed=5)
    after = eplb.rebalance_over_survivors(load, 48, 8, [0, 1, 2, 4, 5, 6], num_groups=4, num_nodes=2)
    check_placement(after, 32, 48, 8, alive=[0, 1, 2, 4, 5, 6])
    uneven = eplb.rebalance_over_survivors(load, 48, 8, [0, 1, 2, 3, 4, 5, 6], num_groups=4, num_nodes=2)
    check_placement(uneven, 32, 48, 8, alive=[0, 1, 2, 3, 4, 5, 6])


def test_survivors_without_room_name_the_experts() -> None:
    load = torch.arange(1, 9, dtype=torch.float64).view(1, 8)  # expert 0 lightest
    with pytest.raises(UsageError, match=r"4 slots cannot hold the 8 logical experts.*layer 0: \[0, 1, 2, 3\]"):
        eplb.rebalance_over_survivors(load, 8, 4, [1, 3])
    with pytest.raises(UsageError, match="no expert GPU survives"):
        eplb.rebalance_over_survivors(load, 8, 4, [])
    with pytest.raises(UsageError, match="outside 0..3"):
        eplb.rebalance_over_survivors(load, 8, 4, [4])


def test_orphaned_experts_are_those_with_every_replica_dead() -> None:
    phy2log = torch.tensor([[0, 1, 2, 0, 3, 4, 5, 6, 7, 8, 9, 2]])  # 4 GPUs x 3 slots
    assert eplb.orphaned_experts(phy2log, 4, [0, 1, 2, 3]) == {}
    assert eplb.orphaned_experts(phy2log, 4, [1, 2, 3]) == {0: [1]}  # 0 and 2 have a copy elsewhere
    assert eplb.orphaned_experts(phy2log, 4, [0, 1]) == {0: [5, 6, 7, 8, 9]}


def test_migration_plan_copies_from_live_replicas_and_restores_the_rest() -> None:
    old = torch.tensor([[0, 1, 2, 0, 3, 4, 5, 6, 7, 8, 9, 2]])  # 4 GPUs x 3 slots
    assert eplb.migration_plan(old, old, 4) == []
    new = torch.tensor([[0, 1, 2, 0, 3, 4, -1, -1, -1, 8, 9, 2]])  # GPU 2 died: slots 6-8 empty, nothing to move
    assert eplb.migration_plan(old, new, 4, alive_gpus=[0, 1, 3]) == []
    new = torch.tensor([[0, 1, 5, 6, 3, 7, -1, -1, -1, 8, 9, 2]])
    moves = eplb.migration_plan(old, new, 4, alive_gpus=[0, 1, 3])
    # Experts 5, 6 and 7 lived only on the dead GPU 2: restored from a copy.
    assert moves == [eplb.Move(0, 2, 5, None), eplb.Move(0, 3, 6, None), eplb.Move(0, 5, 7, None)]
    swap = torch.tensor([[2, 1, 0, 0, 3, 4, 5, 6, 7, 8, 9, 2]])
    assert eplb.migration_plan(old, swap, 4) == [eplb.Move(0, 0, 2, 2), eplb.Move(0, 2, 0, 0)]  # same-GPU sources


def test_elastic_round_trip_every_expert_served_after_a_loss() -> None:
    load = eplb.zipf_load(2, 16, seed=4)
    before = eplb.rebalance_experts(load, 24, 1, 1, 4)
    alive = [0, 1, 3]
    after = eplb.rebalance_over_survivors(load, 24, 4, alive)
    moves = eplb.migration_plan(before.phy2log, after.phy2log, 4, alive_gpus=alive)
    restored = {(m.layer, m.expert) for m in moves if m.source is None}
    lost = eplb.orphaned_experts(before.phy2log, 4, alive)
    assert restored == {(layer, e) for layer, experts in lost.items() for e in experts}
    for m in moves:
        assert m.source is None or (before.phy2log[m.layer, m.source] == m.expert and m.source // 6 in alive)
        assert m.slot // 6 in alive


def test_check_elastic_layout() -> None:
    eplb.check_elastic_layout(16, 24, 4, 1)  # 3 survivors x 6 slots hold 16 experts
    with pytest.raises(UsageError, match="15 slots cannot hold the 16"):
        eplb.check_elastic_layout(16, 20, 4, 1)
    with pytest.raises(UsageError, match=r"num_replicas >= 24 \(redundant experts >= 8\)"):
        eplb.check_elastic_layout(16, 16, 4, 1)
    with pytest.raises(UsageError, match="leaves none to serve"):
        eplb.check_elastic_layout(16, 32, 4, 4)


@pytest.mark.parametrize(("load", "args", "message"), [
    (torch.ones(2, 16), (12, 1, 1, 4), "num_replicas=12 is below the 16 logical experts"),
    (torch.ones(2, 16), (18, 1, 1, 4), "num_replicas=18 does not divide over num_gpus=4"),
    (torch.ones(2, 16), (16, 1, 3, 4), "num_gpus=4 does not divide over num_nodes=3"),
    (torch.ones(2, 16), (16, 3, 1, 4), "num_groups=3 does not divide"),
    (torch.ones(16), (16, 1, 1, 4), r"\[layers, logical_experts\]"),
    (-torch.ones(2, 16), (16, 1, 1, 4), "negative"),
    (torch.ones(2, 16), (0, 1, 1, 4), "num_replicas=0 must be a positive integer"),
])
def test_layout_errors_name_the_setting(load, args, message) -> None:
    with pytest.raises(UsageError, match=message):
        eplb.rebalance_experts(load, *args)


def test_choose_replicas_is_position_modulo_count() -> None:
    placement = eplb.rebalance_experts(torch.tensor([[90.0, 1, 1, 1, 1, 1, 1, 1]]), 12, 1, 1, 4)
    log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
    ids = torch.zeros(10, 1, dtype=torch.long)
    slots = eplb.choose_replicas(ids, torch.arange(10), log2phy, logcnt)
    replicas = log2phy[0, :5].tolist()
    assert slots.flatten().tolist() == [replicas[i % 5] for i in range(10)]
    dead = placement.logcnt.clone()[0]
    dead[3] = 0
    with pytest.raises(UsageError, match=r"experts \[3\] have no live replica"):
        eplb.choose_replicas(torch.tensor([[3]]), torch.tensor([0]), log2phy, dead)


def test_worker_tables_for_an_engine() -> None:
    load = eplb.zipf_load(3, 8, seed=2)
    placement = eplb.rebalance_experts(load.sum(0, keepdim=True), 12, 1, 1, 4)  # one placement for all layers
    held = eplb.experts_on_gpus(placement.phy2log[0], 4)
    assert [len(row) for row in held] == [3, 3, 3, 3] and set(sum(held, [])) == set(range(8))
    slots = eplb.choose_replicas(torch.arange(8).view(8, 1), torch.arange(8), placement.log2phy[0],
                                 placement.logcnt[0])
    gpus = eplb.slot_gpus(slots, 12, 4)
    assert all(expert in held[int(gpu)] for expert, gpu in zip(range(8), gpus.flatten(), strict=True))
    after = eplb.rebalance_over_survivors(load.sum(0, keepdim=True), 12, 4, [0, 1, 3])
    assert eplb.experts_on_gpus(after.phy2log[0], 4)[2] == []


def test_load_recorder_sliding_window() -> None:
    recorder = eplb.ExpertLoadRecorder(num_layers=2, num_logical_experts=4, window=2)
    recorder.record(0, torch.tensor([[0, 1], [1, 1]]))
    recorder.record(1, torch.tensor([3]))
    assert recorder.load().tolist() == [[1, 3, 0, 0], [0, 0, 0, 1]]
    recorder.advance()
    recorder.record(0, torch.tensor([2]))
    assert recorder.load().tolist() == [[1, 3, 1, 0], [0, 0, 0, 1]]
    recorder.advance()  # the first step drops out of the window
    assert recorder.load().tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    assert recorder.steps == 2
    with pytest.raises(UsageError, match="expert ids must be in 0..3"):
        recorder.record(0, torch.tensor([4]))
    with pytest.raises(UsageError, match="layer 2 is outside"):
        recorder.record(2, torch.tensor([0]))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, int, int]:
    nodes = draw(st.sampled_from([1, 2]))
    gpus = nodes * draw(st.integers(1, 4))
    groups = nodes * draw(st.integers(1, 3))
    experts = groups * draw(st.integers(1, 4))
    per_gpu = max(1, -(-experts // gpus)) + draw(st.integers(0, 2))
    layers = draw(st.integers(1, 3))
    values = draw(st.lists(st.integers(0, 1000), min_size=layers * experts, max_size=layers * experts))
    return torch.tensor(values, dtype=torch.float64).view(layers, experts), per_gpu * gpus, groups, nodes, gpus


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_property_every_layout_gives_a_valid_placement(layout: tuple[torch.Tensor, int, int, int, int]) -> None:
    load, replicas, groups, nodes, gpus = layout
    placement = eplb.rebalance_experts(load, replicas, groups, nodes, gpus)
    check_placement(placement, load.shape[1], replicas, gpus)
    loads = eplb.gpu_loads(load, placement.phy2log, gpus)
    assert torch.allclose(loads.sum(dim=1), load.sum(dim=1)), "no load lost or invented"


@settings(max_examples=40, deadline=None)
@given(layouts(), st.data())
def test_property_survivors_cover_every_expert_when_room_allows(layout: tuple[torch.Tensor, int, int, int, int],
                                                                data: st.DataObject) -> None:
    load, replicas, groups, nodes, gpus = layout
    alive = data.draw(st.lists(st.integers(0, gpus - 1), min_size=1, unique=True))
    if (replicas // gpus) * len(alive) < load.shape[1]:
        with pytest.raises(UsageError, match="cannot hold"):
            eplb.rebalance_over_survivors(load, replicas, gpus, alive, groups, nodes)
        return
    placement = eplb.rebalance_over_survivors(load, replicas, gpus, alive, groups, nodes)
    check_placement(placement, load.shape[1], replicas, gpus, alive=sorted(alive))


@pytest.mark.parametrize(("groups", "gpus", "slots", "experts", "hosts", "nodes"), [
    (8, 16, 256 + 32, 256, 1, 8),  # DeepSeek-V3 on 16 workers: a pair of workers per group
    (8, 4, 256, 256, 1, 4),  # no redundancy: two groups per worker
    (8, 4, 256 + 32, 256, 1, 2),  # redundancy: two workers per node, so a replica can leave its twin's GPU
    (8, 4, 256 + 32, 256, 2, 2),  # two hosts: the hosts are the nodes
    (8, 6, 256 + 32, 256, 3, 1),  # 8 groups do not divide over 3 hosts: global
    (4, 4, 8 + 4, 8, 1, 2),  # the tiny GLM-4.5 with 4 redundant slots
    (3, 4, 12, 12, 1, 1),  # 3 groups and 4 workers share no divisor: global
    (1, 4, 12, 8, 1, 1),  # no groups
    (4, 4, 4 * 7, 8, 1, 1),  # 7 slots a worker but 2 or 4 experts a node: a node cannot fill its workers
])
def test_group_nodes_uses_hosts_then_sets_of_workers(groups, gpus, slots, experts, hosts, nodes) -> None:
    assert eplb.group_nodes(groups, gpus, slots, experts, hosts) == nodes


def test_hierarchical_replicas_of_an_expert_are_at_most_the_gpus_of_its_node() -> None:
    # Expert 0 is hot enough for every extra slot of its node, but its node has 2 GPUs: a third replica would
    # share a GPU with another and balance nothing, so the other extra slot goes to another expert of the node.
    load = torch.tensor([[1000.0, 1, 1, 1, 1, 1, 1, 1]])
    phy2log = eplb.rebalance_experts(load, 12, 4, 2, 4).phy2log[0].tolist()
    assert phy2log.count(0) == 2
    assert eplb.rebalance_experts(load, 12, 1, 1, 4).logcnt[0, 0] == 5  # the global policy has no such limit
    for node in (phy2log[:6], phy2log[6:]):  # each node: whole groups of 2 experts, 2 of the 4
        assert len({e // 2 for e in node}) == 2
