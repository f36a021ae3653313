"""A weight source that dies in the middle of a move (real worker processes on the tiny checkpoint): the expert
worker that was to receive its experts reads them from the checkpoint instead, the report names that fallback,
and every greedy output still equals `transformers`' (the run without a failure).

The source is killed at a deterministic point by the test hook `moves.MOVE_FAULT_ENV` (`EPOCH:MESSAGES`): in the
moves of layout epoch EPOCH, the lowest-index expert worker that sends weights SIGKILLs itself once it has sent
MESSAGES of its weight messages."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.serving.elastic.moves import MOVE_FAULT_ENV, move_fault
from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from tests.unit_tests.serving.engine_runs import leftovers, requests_of

MAX_NEW = 10


def test_the_move_fault_hook_names_its_victim_and_rejects_bad_values(monkeypatch):
    from mbridge_epoverlap.errors import UsageError

    plan = {(None, 0): [1], (2, 0): [3], (1, 3): [0], (2, 3): [1]}
    monkeypatch.setenv(MOVE_FAULT_ENV, "1:0")
    assert [move_fault(1, plan, w) for w in range(4)] == [None, 0, None, None]  # worker 1: the lowest source
    assert move_fault(2, plan, 1) is None  # another epoch
    monkeypatch.setenv(MOVE_FAULT_ENV, "one")
    with pytest.raises(UsageError, match="expected EPOCH:MESSAGES"):
        move_fault(1, plan, 1)


@pytest.mark.parametrize(("elastic", "killed"), [
    ({"rebalance_every": 3, "rebalance_threshold": 1.0}, []),  # a few prompts: below the routing noise
    ({"kill": 1, "kill_step": 2, "rejoin_after_steps": 2, "rejoin_hold": True}, [0]),
], ids=["rebalance", "rejoin"])
def test_a_source_lost_mid_move_falls_back_to_the_checkpoint(tiny_mixtral_dir, prompts, hf_greedy, monkeypatch,
                                                             elastic, killed):
    # Layout epoch 1 moves experts between the expert workers: the first rebalance, or the admission of the
    # replacement of expert worker 0 (killed at step 2). Its lowest-index source dies before sending any of them
    # (the workers' environment carries the hook).
    monkeypatch.setenv(MOVE_FAULT_ENV, "1:0")
    spec = load_spec(tiny_mixtral_dir)
    plan = make_plan(spec, requests_of(prompts), expert_workers=4, micro_batches=2, max_new_tokens=MAX_NEW,
                     timeout_s=20)
    plan = make_elastic(plan, redundant=4, **elastic)
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    assert result["failed_requests"] == []
    report = result["elastic"]
    sources = [w for w in report["lost_workers"] if w not in killed]
    assert len(sources) == 1, report["lost_workers"]
    source = sources[0]
    fallbacks = report["move_fallbacks"]
    assert fallbacks and all(f["from"] == source and f["epoch"] == 1 and f["read"] == "checkpoint"
                             for f in fallbacks)
    assert all(f["worker"].startswith("expert ") and f["worker"] != f"expert {source}" for f in fallbacks)
    assert report["event_counts"]["move_fallbacks"] == len(fallbacks)
    assert report["event_counts"]["workers_lost"] == 1 + len(killed)
    # The epoch entered no longer counts the source: the attention workers dropped it again at the switch.
    lead = [e for e in report["events"] if e["worker"] == "attention 0"]
    entered = next(i for i, e in enumerate(lead) if e["event"] in ("rebalanced", "rejoined") and e["epoch"] == 1)
    placed = next(e for e in lead[entered:] if e["event"] == "re-placed")
    assert source not in placed["alive"]
    assert leftovers(pids) == ([], [])
