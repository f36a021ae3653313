"""Elastic EP layout epochs: the placement changes while requests flow, with transformers' greedy tokens.

Real worker processes on the tiny real checkpoint (the serving fixtures): rebalancing every few decode steps
moves expert weights between expert workers over M2N; a SIGKILLed expert worker is replaced by a new process
that connects to the running workers, receives its experts' weights and is placed again.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.comm.m2n import mooncake_available
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.elastic.layout import ElasticLayout
from mbridge_epoverlap.serving.elastic.moves import transfers
from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.workers.requests import Request
from tests.unit_tests.requirements import require_or_skip
from tests.unit_tests.serving.engine_runs import leftovers as _leftovers
from tests.unit_tests.serving.engine_runs import requests_of as _requests

MAX_NEW = 10


def test_transfers_bring_each_gained_expert_from_a_live_holder():
    old = ElasticLayout.initial(4, 4, 4)
    new = old.resolved(old.alive, torch.tensor([90, 10, 10, 10]))
    plan = transfers(old, new)
    assert plan  # the hot expert gains replicas
    for (source, destination), experts in plan.items():
        for expert in experts:
            assert expert in old.experts_of(source) and expert not in old.experts_of(destination)
            assert expert in new.experts_of(destination)
    assert new.imbalance(torch.tensor([90, 10, 10, 10])) < old.imbalance(torch.tensor([90, 10, 10, 10]))
    joined = old.without({2})[0]
    back = joined.resolved(joined.alive | {2})
    gains = {dst: ids for (src, dst), ids in transfers(joined, back).items() if dst == 2}
    assert sorted(set(sum(gains.values(), []))) == back.experts_of(2)  # the newcomer gets its whole share


def test_a_rejoin_fills_the_newcomers_slots_and_moves_nothing_else():
    after = ElasticLayout.initial(8, 8, 8).without({0})[0]
    back = after.rejoined({0})
    assert back.alive == set(range(8)) and back.slots[2:] == after.slots[2:]
    moves = transfers(after, back)
    assert {dst for _, dst in moves} == {0} and sorted(sum(moves.values(), [])) == back.experts_of(0)
    assert sorted(back.replica_counts()) == [2] * 8  # the two experts that lost a replica get it back
    hot = after.rejoined({0}, torch.tensor([10, 10, 10, 10, 10, 10, 80, 10]))
    assert 6 in hot.experts_of(0)  # the most load per replica first


@pytest.mark.numerics
def test_expert_store_builds_a_share_from_held_and_received_weights(tiny_mixtral_dir):
    from mbridge_epoverlap.serving.model.expert_store import ExpertStore

    spec = load_spec(tiny_mixtral_dir)
    mine, theirs, reference = ExpertStore(spec, [0, 1]), ExpertStore(spec, [2, 3]), ExpertStore(spec, [0, 1, 2, 3])
    w1, w2 = theirs.export([3])
    part = mine.build([1, 3], {3: (w1[:, 0], w2[:, 0])})
    assert mine.held == {0, 1}  # nothing changes before the switch
    assert mine.adopt(part) == [0] and mine.held == {1, 3}
    tokens, ids = torch.randn(6, spec.hidden_size), torch.tensor([1, 3, 3, 1, 3, 1])
    layer = spec.moe_layer_ids[-1]
    assert torch.equal(mine(layer, tokens, ids), reference(layer, tokens, ids))


def test_expert_store_computes_packed_and_repacks_only_what_it_gains(tiny_mixtral_dir):
    from mbridge_epoverlap.serving.model import packed as packed_gemm
    from mbridge_epoverlap.serving.model.expert_store import ExpertStore

    spec = load_spec(tiny_mixtral_dir)
    if not packed_gemm.available(spec.torch_dtype()):
        pytest.skip("this torch has no packed expert GEMMs")
    layer = spec.moe_layer_ids[-1]

    def packed(part, expert):  # the tensors the part computes `expert` with (none FP8: a float checkpoint)
        return tuple(t for t in part.packed_layers[str(layer)].packed_of(int(part.local_index[expert]))
                     if t is not None)

    mine, theirs, reference = ExpertStore(spec, [0, 1]), ExpertStore(spec, [2, 3]), ExpertStore(spec, [0, 1, 2, 3])
    assert [bool(p.packed_layers) for p in mine.parts] == [True]
    held = {e: packed(mine.parts[0], e) for e in (0, 1)}
    part = mine.build([1, 3], {3: tuple(t[:, 0] for t in theirs.export([3]))})
    assert part.packed_layers and all(a is b for a, b in zip(packed(part, 1), held[1], strict=True))
    assert not any(a is b for a in packed(part, 3) for b in packed(theirs.parts[0], 3))  # received: packed here
    mine.adopt(part)
    # a loss: expert 0 comes back from the retiring weights (their packed copy), expert 2 from the checkpoint
    assert mine.ensure([0, 1, 2, 3]) == [0, 2] and all(p.packed_layers for p in mine.parts)
    zero = next(p for p in mine.parts if 0 in p.expert_ids)
    assert all(a is b for a, b in zip(packed(zero, 0), held[0], strict=True))
    assert mine.retire() == []
    two = next(p for p in mine.parts if p.expert_ids == (2,))
    assert mine.build([2], {}) is two  # a part that is exactly the new share is kept, not rebuilt
    tokens, ids = torch.randn(8, spec.hidden_size), torch.tensor([0, 1, 2, 3, 3, 2, 1, 0])
    assert torch.equal(mine(layer, tokens, ids), reference(layer, tokens, ids))
    assert [e.tolist() for e in mine.export([0, 3])] == [e.tolist() for e in reference.export([0, 3])]


def test_rebalancing_while_decoding_moves_experts_and_keeps_tokens(tiny_mixtral_dir, prompts, hf_greedy):
    spec = load_spec(tiny_mixtral_dir)
    plan = make_plan(spec, _requests(prompts), expert_workers=4, micro_batches=2, max_new_tokens=MAX_NEW,
                     timeout_s=20)
    plan = make_elastic(plan, redundant=4, rebalance_every=3, rebalance_threshold=1.0)  # below the routing noise too
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    rebalances = result["elastic"]["rebalances"]
    moved = [r for r in rebalances if r["moved"]]
    assert moved, rebalances
    assert all(r["imbalance_after"] < r["imbalance_before"] for r in moved)
    received = [e for e in result["elastic"]["events"] if e["event"] == "moved" and e["received"]]
    assert received  # an expert worker got weights from another one
    assert _leftovers(pids) == ([], [])


@pytest.mark.parametrize("backend", ["m2n", "mooncake", "torch"])
def test_a_replacement_expert_worker_joins_back_with_the_same_tokens(tiny_mixtral_dir, prompts, hf_greedy, backend):
    # Two attention workers: they agree on the admission and on the rebalances through the store. On mooncake
    # the replacement's channels are re-opened in the running workers' registered regions, on torch as new pair
    # process groups (`connect`).
    if backend == "mooncake" and not mooncake_available():
        require_or_skip("mooncake", "mooncake.engine does not import (install mooncake-transfer-engine-non-cuda)")
    spec = load_spec(tiny_mixtral_dir)
    # The hold waits up to half the timeout for the replacement: 20 s, as long as a replacement's start (torch,
    # the transport, the weights) took on a loaded 2-core machine (10 s was not always enough there).
    plan = make_plan(spec, _requests(prompts), attn_workers=2, expert_workers=4, micro_batches=2,
                     max_new_tokens=MAX_NEW, timeout_s=40, backend=backend)
    # Held at the admission step: the replacement joins at a fixed step, before the short run ends.
    plan = make_elastic(plan, redundant=4, kill=1, kill_step=2, rejoin_after_steps=2, rebalance_every=3,
                        rejoin_hold=True)
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    assert result["failed_requests"] == []
    elastic = result["elastic"]
    assert elastic["lost_workers"] == [0] and elastic["rejoined_workers"] == [0]
    assert elastic["rejoined_after_s"] > elastic["detected_after_s"]
    assert len(pids) == 7  # the six workers and the replacement
    joined = [e for e in elastic["events"] if e["event"] == "joined"]
    assert joined and joined[0]["step"] >= 2 + 2  # admitted rejoin_after_steps after the loss
    epochs = {w: [(e["step"], e["epoch"], e["slots"]) for e in elastic["events"]
                  if e["worker"] == w and e["event"] in ("rebalanced", "rejoined")]
              for w in ("attention 0", "attention 1")}
    assert epochs["attention 0"] == epochs["attention 1"]  # both switched to the same tables at the same steps
    got = [e for e in elastic["events"] if e["worker"] == "expert 0" and e["event"] == "moved"]
    assert got and got[0]["received"]  # its experts came from the survivors
    assert _leftovers(pids) == ([], [])


@pytest.mark.parametrize(("flags", "message"), [
    (["--rebalance-every", "-1"], "argument --rebalance-every: -1 must be at least 0"),
    (["--rejoin-after-steps", "x"], "argument --rejoin-after-steps: 'x' is not an integer"),
    (["--rejoin-after-steps", "2", "--kill", "0"], "--rejoin-after-steps 2 replaces a killed expert worker"),
])
def test_elastic_bench_epoch_flags_bad_input_exit_2(tiny_mixtral_dir, capsys, flags, message):
    from mbridge_epoverlap.cli import main

    try:
        code = main(["elastic-bench", "--checkpoint", str(tiny_mixtral_dir), "--expert-workers", "2",
                     "--redundant-experts", "2", "--json", *flags])
    except SystemExit as exc:  # argparse rejects a bad value itself
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_serve_epoch_flags_need_elastic(tiny_mixtral_dir, tmp_path, capsys):
    from mbridge_epoverlap.cli import main

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt_ids": [5, 6]}\n')
    assert main(["serve", "--checkpoint", str(tiny_mixtral_dir), "--prompts", str(path),
                 "--rebalance-every", "4"]) == 2
    assert "add --elastic" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--rebalance-every -2 must be >= 1"):
        make_elastic(make_plan(load_spec(tiny_mixtral_dir), [Request("a", (5, 6))], expert_workers=2),
                     redundant=2, rebalance_every=-2)
