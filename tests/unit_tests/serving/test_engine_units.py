"""In-process pieces of the serving engine: placement table, prompts, continuous batching, roles, replay."""

from __future__ import annotations

import json

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.program import FORWARD_STAGES, Role, check_schedule
from mbridge_epoverlap.schedule.serving_orders import ping_pong
from mbridge_epoverlap.serving.engine.plan import EnginePlan
from mbridge_epoverlap.serving.workers.placement import Placement
from mbridge_epoverlap.serving.workers.requests import Request, RequestQueue, load_prompts


def test_placement_is_a_table_and_rejects_what_cannot_run():
    table = Placement.balanced(10, 3)
    assert table.owner == (0, 0, 0, 0, 1, 1, 1, 2, 2, 2)
    assert table.experts_of(1) == [4, 5, 6]
    custom = Placement.from_list([2, 0, 1, 0], 3)  # any table, not arithmetic on ids
    assert custom.experts_of(0) == [1, 3]
    with pytest.raises(UsageError, match="more than the model's 4 experts"):
        Placement.balanced(4, 5)
    with pytest.raises(UsageError, match="without an expert"):
        Placement.from_list([0, 0], 2)
    with pytest.raises(UsageError, match="outside 0..1"):
        Placement.from_list([0, 2], 2)


def test_load_prompts_names_the_line_and_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt_ids": [1, 2]}\n\n{"prompt_ids": [3]}\n')
    requests = load_prompts(path, vocab_size=10)
    assert requests == [Request("a", (1, 2)), Request("1", (3,))]
    path.write_text(json.dumps({"id": "t", "prompt": "hi"}) + "\n")
    assert load_prompts(path, vocab_size=10, tokenizer=lambda text: [len(text)])[0].prompt_ids == (2,)


@pytest.mark.parametrize(("text", "needle"), [
    ('{"id": "a", "prompt_ids": []}', "non-empty list"),
    ('{"id": "a"}', 'missing "prompt_ids"'),
    ('{"id": "a", "prompt": "hi"}', "needs a checkpoint with a tokenizer"),
    ('{"id": "a", "prompt_ids": [1]}\n{"id": "a", "prompt_ids": [2]}', "appears twice"),
    ("[1, 2]", "expected an object"),
    ("", "no requests"),
])
def test_load_prompts_rejects_bad_lines(tmp_path, text, needle):
    path = tmp_path / "p.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(UsageError, match=needle):
        load_prompts(path, vocab_size=10)


def test_queue_admits_at_step_boundaries_and_retires_finished_ones():
    queue = RequestQueue([Request(str(i), (1,)) for i in range(3)], max_batch=2, max_new_tokens=2, eos_ids=[9])
    admitted, _ = queue.step_boundary()
    assert [s.request.id for s in admitted] == ["0", "1"] and len(queue.waiting) == 1
    first, second = queue.running
    queue.append_token(first, 9)  # EOS: done after one token (kept in the output)
    queue.append_token(second, 4)
    admitted, retired = queue.step_boundary()
    assert [s.request.id for s in retired] == ["0"] and [s.request.id for s in admitted] == ["2"]
    queue.append_token(second, 5)  # the token limit
    assert second.finished
    results = {c["id"]: c for c in queue.completions(failed=True)}
    assert results["0"]["output_ids"] == [9] and results["0"]["status"] == "ok"
    assert results["1"]["status"] == "ok" and len(results["1"]["tbt_ms"]) == 1
    assert results["2"]["status"] == "failed" and results["2"]["ttft_ms"] is None


def test_roles_split_the_ping_pong_order_as_the_stage_table_says():
    from mbridge_epoverlap.serving.workers.decode import role_steps

    order = ping_pong(3, 2)
    attention, expert = role_steps(order, Role.ATTENTION), role_steps(order, Role.EXPERT)
    # Per (micro-batch, layer): attention runs attn and post, issues dispatch and waits for combine; the
    # experts run the other three steps. 3 micro-batches x 2 layers of each.
    assert {(s.stage, s.phase.value) for s in attention} == {("attn", "run"), ("dispatch", "issue"),
                                                             ("combine", "wait"), ("post", "run")}
    assert (len(attention), len(expert)) == (4 * 3 * 2, 3 * 3 * 2)
    assert {s.stage for s in expert} == {"dispatch", "experts", "combine"}
    assert {(s.stage, s.phase.value) for s in expert} == {("dispatch", "wait"), ("experts", "run"),
                                                          ("combine", "issue")}
    # Each role's steps keep the order's relative order.
    assert attention == [s for s in order if s in set(attention)]
    # Every transfer crosses from one role to the other: its WAIT runs on the receiving side.
    assert {(s.name, s.role, s.to_role) for s in FORWARD_STAGES if s.to_role is not None} == {
        ("dispatch", Role.ATTENTION, Role.EXPERT), ("combine", Role.EXPERT, Role.ATTENTION)}


def test_plan_places_roles_by_rank_and_round_trips():
    plan = EnginePlan(source="qwen3_30b_a3b", attn_workers=2, expert_workers=3, placement=(0, 1, 2),
                      requests=(({"id": "a", "prompt_ids": [1]},), ()))
    assert plan.world == 5 and plan.attention_ranks == [0, 1] and plan.expert_ranks == [2, 3, 4]
    assert plan.rank_names()[3] == "expert worker 1 (rank 3)"
    assert EnginePlan.from_json(plan.to_json()) == plan
    colocated = EnginePlan(source="x", processes=2)
    assert colocated.world == 2 and colocated.role_of(1) == (None, 1)


def test_plan_mode_is_derived_and_an_old_plan_with_a_mode_key_still_loads():
    colocated, split = EnginePlan(source="x", processes=2), EnginePlan(source="x")
    assert (colocated.mode, split.mode) == ("colocated", "disaggregated")
    raw = json.loads(colocated.to_json())
    assert "mode" not in raw
    assert EnginePlan.from_json(json.dumps({**raw, "mode": "colocated"})) == colocated


def test_requests_dealt_round_robin_come_back_in_arrival_order():
    from mbridge_epoverlap.serving.engine.plan import deal_requests

    requests = [Request(f"r{i}", (i + 1,)) for i in range(5)]
    dealt = deal_requests(requests, 2)
    assert [[r["id"] for r in d] for d in dealt] == [["r0", "r2", "r4"], ["r1", "r3"]]
    plan = EnginePlan(source="x", attn_workers=2, requests=dealt)
    assert plan.arrival_order() == [r.id for r in requests]
    assert plan.arrival_requests() == requests


def test_replay_transfer_is_the_fastest_tenth_of_the_raw_round_trips_filtered_once():
    """The worker's timer keeps its fastest tenth of the round trips; the replay must not filter again."""
    import random
    import statistics

    from mbridge_epoverlap.serving.engine.replay import stage_times_ms
    from mbridge_epoverlap.serving.workers.stage_timer import StageTimer

    trips_ms = [float(t) for t in range(1, 101)]
    random.Random(0).shuffle(trips_ms)
    timer = StageTimer(frozenset())
    for t in trips_ms:
        timer.record("round_trip", t / 1e3)
    reader = {"role": "attention", "stages": timer.summary()}
    holder = {"role": "expert", "stages": {"median_ms": {"experts": 0.5}}}
    stages = stage_times_ms([reader], [holder])
    fastest_tenth = sorted(trips_ms)[:10]
    assert stages["dispatch"] == stages["combine"] == pytest.approx((statistics.median(fastest_tenth) - 0.5) / 2)


def test_step_overhead_is_the_step_outside_its_stages_nested_ones_counted_once():
    import time

    from mbridge_epoverlap.serving.workers.stage_timer import OVERHEAD_STAGE, StageTimer

    timer = StageTimer(frozenset({"attn"}))
    timer.step_started()
    time.sleep(0.02)  # untimed: overhead
    with timer.time("post"), timer.time("sample"):  # sample inside post: its time is post's, counted once
        time.sleep(0.03)
    timer.step_done()
    timer.step_started()
    time.sleep(0.05)
    timer.step_done(record=False)  # a step without work (an idle server's wait) is not overhead
    (overhead,) = timer.samples[OVERHEAD_STAGE]
    assert 0.02 <= overhead < 0.03 and timer.timed_s >= 0.03


def test_replay_adds_the_measured_step_overhead_once_per_step():
    from mbridge_epoverlap.serving.engine.replay import replay
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    spec = load_spec("qwen3_30b_a3b")
    requests = [Request("a", (1, 2))]
    stages = {"attn": 1.0, "experts": 1.0, "post": 0.1, "dispatch": 0.1, "combine": 0.1, "sample": 0.5}
    for layout in ({"micro_batches": 2}, {"colocated": 2, "micro_batches": 1, "order": "sequential"}):
        plan = make_plan(spec, requests, **layout)
        without = replay(plan, stages, tokens_per_step=2)["step_ms"]
        assert replay(plan, {**stages, "overhead": 7.0}, tokens_per_step=2)["step_ms"] == pytest.approx(without + 7.0)


def test_replay_of_balanced_stages_predicts_the_ping_pong_gain():
    from mbridge_epoverlap.serving.engine.replay import replay
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    spec = load_spec("qwen3_30b_a3b")
    requests = [Request("a", (1, 2))]
    stages = {"attn": 1.0, "experts": 1.0, "post": 0.0, "dispatch": 0.1, "combine": 0.1}
    one, two = (replay(make_plan(spec, requests, micro_batches=m), stages, tokens_per_step=m) for m in (1, 2))
    # Streamed decode steps: no fill and drain per step, so balanced stages come close to 2x.
    assert two["tokens_per_s"] / one["tokens_per_s"] > 1.8
    assert one["utilization"]["attention"] < 0.5 < 0.9 < two["utilization"]["attention"]


def test_decode_steps_chain_as_layers_do():
    from mbridge_epoverlap.schedule.serving_orders import ping_pong_round, ping_pong_tail

    # Three decode steps of two layers streamed back to back are the ping-pong over six layers.
    rounds = [step for layer in range(6) for step in ping_pong_round(2, layer)]
    assert rounds + ping_pong_tail(2, 6) == ping_pong(2, 6)
    check_schedule(ping_pong(2, 6))


@pytest.mark.parametrize(("layout", "budget"), [
    (dict(colocated=2, micro_batches=1), 1024),  # each rank admits once a step
    (dict(attn_workers=1, micro_batches=2), 1024),  # the attention worker admits at each micro-batch's boundary
    (dict(attn_workers=2, micro_batches=2), 512),
])
def test_an_online_step_starts_at_most_its_prefill_tokens_over_its_attention_workers(tiny_mixtral_dir, layout,
                                                                                     budget):
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    spec = load_spec(tiny_mixtral_dir)
    plan = make_plan(spec, [], online_requests=["tcp://127.0.0.1:1"] * (layout.get("colocated") or
                                                                        layout["attn_workers"]),
                     online_events="tcp://127.0.0.1:2", max_model_len=64, max_prefill_tokens=2048, **layout)
    assert plan.prefill_budget == budget
    row_bytes = spec.hidden_size * 4 + 8
    assert plan.slot_bytes >= budget * spec.top_k * row_bytes  # a full admission's dispatch fits a slot
    small = make_plan(spec, [], online_requests=plan.online_requests, online_events=plan.online_events,
                      max_model_len=64, **layout)
    assert small.prefill_budget == 0 and small.slot_bytes < plan.slot_bytes  # no budget: max_model_len each


def test_an_admission_fills_the_prefill_budget_and_the_last_prompt_starts_with_a_chunk():
    queue = RequestQueue([Request(str(i), tuple(range(40))) for i in range(5)], max_batch=8, max_new_tokens=4,
                         eos_ids=())
    queue.prefill_budget = 100
    admitted, _ = queue.step_boundary()
    assert [s.request.id for s in admitted] == ["0", "1", "2"]  # 40 + 40 + the first 20 of the third
    assert [s.chunk for s in admitted] == [40, 40, 20] and [s.samples for s in admitted] == [True, True, False]
    for seq in admitted:  # the step ran: the chunks are in the cache, the whole prompts sampled a token
        seq.fed, seq.chunk = seq.fed + seq.chunk, 0
        if seq.fed == seq.length:
            queue.append_token(seq, 7)
    queue.prefill_budget = 10
    admitted, _ = queue.step_boundary()
    assert admitted == []  # the third's 20 left fill the budget: nobody new starts
    third = queue.running[2]
    assert (third.chunk, third.samples, third.prefill_left) == (10, False, 20)
    assert all(s.chunk == 0 and s.feeds and s.samples for s in queue.running[:2])  # they decode


def test_prefilling_sequences_past_the_budget_wait_for_a_later_step():
    queue = RequestQueue([Request(str(i), tuple(range(30))) for i in range(3)], max_batch=8, max_new_tokens=4,
                         eos_ids=())
    queue.prefill_budget = 1000
    queue.step_boundary()  # all three start whole
    queue.prefill_budget = 45
    queue.assign_chunks(queue.running)  # the same step's chunks under a smaller budget
    assert [s.chunk for s in queue.running] == [30, 15, 0]
    assert [s.feeds for s in queue.running] == [True, True, False]
    queue.prefill_budget = None  # offline: every prompt whole, in one step
    queue.assign_chunks(queue.running)
    assert [s.chunk for s in queue.running] == [30, 30, 30]


