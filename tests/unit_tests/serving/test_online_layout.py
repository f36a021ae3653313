"""`serve --http` without layout flags measures its layout (`serving.engine.choice.online`): trial runs of the
candidates with requests joining at every step, the fastest taken (one thread per process unless more threads win
by the margin), replicated experts only where memory allows, and the choice cached per model, dtype, batch, cores
and CPU so that the next start reuses it. The trial runs are replaced by given rates here (`trial`);
`frontend/test_server_life.py::test_a_server_without_layout_flags_measures_its_layout` starts a real one."""

from __future__ import annotations

import json

from mbridge_epoverlap.serving.engine.choice import online as online_layout
from mbridge_epoverlap.serving.engine.choice.online import (
    candidates,
    choose_keeping_frontend,
    choose_online_layout,
    expert_bytes,
    worker_cores,
)
from mbridge_epoverlap.serving.model.checkpoint import load_spec


def rates(spec, table: dict[str, float], calls: list[str] | None = None):
    """A trial that answers `table[candidate]` tokens/s (the candidate on 2 cores that has the layout given)."""
    options = candidates(spec, 2)

    def trial(layout, batch, prompt_len):
        name = next(n for n, option in options.items() if option == layout)
        if calls is not None:
            calls.append(name)
        return {"tokens_per_s": table[name]}
    return trial


def test_the_fastest_trial_wins_and_is_said(tiny_mixtral_dir, tmp_path, monkeypatch) -> None:
    spec = load_spec(tiny_mixtral_dir)
    monkeypatch.setattr(online_layout, "experts_tile", lambda spec: False)  # every op of colocated_1 on OpenMP
    table = {"colocated_2_replicated": 900.0, "colocated_2": 800.0, "disaggregated_1+1_m2": 500.0,
             "colocated_1": 700.0}
    choice = choose_online_layout(spec, max_batch=64, max_model_len=256, cores=2, cache_dir=tmp_path,
                                  trial=rates(spec, table))
    assert choice["chosen"] == "colocated_2_replicated" and choice["source"] == "measured"
    assert choice["layout"] == dict(colocated=2, micro_batches=1, order="sequential", threads=1,
                                    replicated_experts=True)
    assert all(name in choice["summary"] for name in table)
    # Two threads in one process must win by the margin: 1.2x the best one-thread layout is not enough.
    table = dict(table, colocated_1=1.2 * 900.0)
    choice = choose_online_layout(spec, max_batch=32, max_model_len=256, cores=2, cache_dir=tmp_path,
                                  trial=rates(spec, table))
    assert choice["chosen"] == "colocated_2_replicated" and "not 1.3x faster" in choice["summary"]
    table = dict(table, colocated_1=1.5 * 900.0)
    choice = choose_online_layout(spec, max_batch=16, max_model_len=256, cores=2, cache_dir=tmp_path,
                                  trial=rates(spec, table))
    assert choice["chosen"] == "colocated_1" and choice["layout"]["threads"] == 2


def test_exchanging_layouts_must_win_by_the_exchange_margin(tiny_mixtral_dir, tmp_path, monkeypatch) -> None:
    """Online the front end takes turns with the workers: processes that exchange at every layer must beat one
    that does not by `EXCHANGE_MARGIN`, and one process whose steps split the tiled expert GEMMs has no OpenMP
    handicap."""
    spec = load_spec(tiny_mixtral_dir)
    monkeypatch.setattr(online_layout, "experts_tile", lambda spec: True)
    table = {"colocated_2_replicated": 500.0, "colocated_2": 959.0, "disaggregated_1+1_m2": 619.0,
             "colocated_1": 854.0}  # the 108M Qwen3-MoE's trial: EP 1.12x one process on both cores
    choice = choose_online_layout(spec, max_batch=64, max_model_len=256, cores=2, cache_dir=tmp_path / "a",
                                  trial=rates(spec, table))
    assert choice["chosen"] == "colocated_1" and choice["layout"]["threads"] == 2
    assert "colocated_2 not 1.2x faster: its processes wait for each other at every layer" in choice["summary"]
    table = dict(table, colocated_2=1.25 * 854.0)
    choice = choose_online_layout(spec, max_batch=64, max_model_len=256, cores=2, cache_dir=tmp_path / "b",
                                  trial=rates(spec, table))
    assert choice["chosen"] == "colocated_2" and "not" not in choice["summary"]
    assert online_layout.handicap(dict(colocated=2, threads=1, replicated_experts=True), splits=True)[0] == 1.0
    assert online_layout.handicap(dict(attn_workers=1, expert_workers=1, threads=1), splits=True)[0] == 1.2
    assert online_layout.handicap(dict(colocated=1, threads=2), splits=False)[0] == online_layout.THREADS_MARGIN


def test_the_choice_is_cached_per_model_batch_cores_and_engine(tiny_mixtral_dir, tmp_path, monkeypatch) -> None:
    spec = load_spec(tiny_mixtral_dir)
    calls: list[str] = []
    table = {"colocated_2_replicated": 600.0, "colocated_2": 900.0, "disaggregated_1+1_m2": 500.0,
             "colocated_1": 700.0}
    first = choose_online_layout(spec, max_batch=64, max_model_len=256, cores=2, cache_dir=tmp_path,
                                 trial=rates(spec, table, calls))
    assert first["chosen"] == "colocated_2" and len(calls) == 4
    again = choose_online_layout(spec, max_batch=64, max_model_len=256, cores=2, cache_dir=tmp_path,
                                 trial=rates(spec, table, calls))
    assert again["source"] == "cached" and again["chosen"] == "colocated_2" and len(calls) == 4
    assert again["layout"] == first["layout"] and again["summary"] == first["summary"]
    # Another batch, or another dtype, is another question.
    choose_online_layout(spec, max_batch=8, max_model_len=256, cores=2, cache_dir=tmp_path,
                         trial=rates(spec, table, calls))
    choose_online_layout(load_spec(tiny_mixtral_dir, dtype="bfloat16"), max_batch=64, max_model_len=256, cores=2,
                         cache_dir=tmp_path, trial=rates(spec, table, calls))
    assert len(calls) == 12
    # So is another version of the engine's code (a kernel changed since): its speed is another answer.
    online_layout.engine_digest.cache_clear()
    assert online_layout.engine_digest() == online_layout.engine_digest()  # the same code, the same digest
    monkeypatch.setattr(online_layout, "engine_digest", lambda: "another engine")
    assert choose_online_layout(spec, max_batch=64, max_model_len=256, cores=2, cache_dir=tmp_path,
                                trial=rates(spec, table, calls))["source"] == "measured"
    assert len(calls) == 16
    # A cache this version cannot read is measured again, not an error.
    (tmp_path / online_layout.CACHE_NAME).write_text("{not json")
    assert choose_online_layout(spec, max_batch=64, max_model_len=256, cores=2, cache_dir=tmp_path,
                                trial=rates(spec, table, calls))["source"] == "measured"
    assert json.loads((tmp_path / online_layout.CACHE_NAME).read_text())


def test_candidates_follow_cores_experts_and_memory(tiny_mixtral_dir) -> None:
    spec = load_spec(tiny_mixtral_dir)  # 4 experts
    assert list(candidates(spec, 1)) == ["colocated_1"]
    assert list(candidates(spec, 2, available_bytes=10**12)) == [
        "colocated_2_replicated", "colocated_2", "disaggregated_1+1_m2", "colocated_1"]
    # EP over more processes than experts is not a layout; replicated experts that would take more than half the
    # memory are not tried.
    assert "colocated_8" not in candidates(spec, 8, available_bytes=10**12)
    tight = candidates(spec, 2, available_bytes=int(expert_bytes(spec) * 1.5))
    assert "colocated_2_replicated" not in tight and "colocated_2" in tight


def test_one_core_runs_no_trial(tiny_mixtral_dir, tmp_path) -> None:
    def trial(*args):
        raise AssertionError("no trial on one core")
    choice = choose_online_layout(load_spec(tiny_mixtral_dir), max_batch=64, max_model_len=256, cores=1,
                                  cache_dir=tmp_path, trial=trial)
    assert choice["chosen"] == "colocated_1" and "the only layout" in choice["summary"]


def test_each_candidate_maps_to_serve_flags(tiny_mixtral_dir) -> None:
    from mbridge_epoverlap.serving.engine.choice.online import as_flags

    options = candidates(load_spec(tiny_mixtral_dir), 2, available_bytes=10**12)
    assert as_flags(options["colocated_2_replicated"]) == dict(
        colocated=2, replicate_experts=True, attn_workers=1, expert_workers=1, micro_batches=1, order="sequential",
        threads=1)
    assert as_flags(options["disaggregated_1+1_m2"]) == dict(
        colocated=0, replicate_experts=False, attn_workers=1, expert_workers=1, micro_batches=2, threads=1)


def test_the_front_end_keeps_a_core_unless_every_core_decodes_a_few_sequences_clearly_faster(tiny_mixtral_dir,
                                                                                              tmp_path) -> None:
    """`--frontend-cores` (default 1) keeps cores for the HTTP front end and the clients: on 2 cores one worker
    with one thread, unless the best layout on both cores decodes `SMALL_BATCH` sequences `SPARE_MARGIN` times
    faster (a model whose steps stream many expert weights); the decision is cached with the rates."""
    assert [worker_cores(n, 1) for n in (1, 2, 16)] == [1, 1, 15] and worker_cores(2, 0) == 2
    spec = load_spec(tiny_mixtral_dir)
    calls: list[tuple[str, int]] = []

    def trial_with(small: dict[str, float]):
        def trial(layout, batch, prompt_len):
            name = "kept" if layout.get("colocated") == 1 and layout["threads"] == 1 else "every"
            calls.append((name, batch))
            if batch == online_layout.SMALL_BATCH:
                return {"tokens_per_s": small[name]}
            ep = layout.get("colocated") == 2 and not layout.get("replicated_experts")  # EP wins the full batch
            return {"tokens_per_s": 700.0 if ep else 300.0}
        return trial

    common = dict(max_batch=64, max_model_len=256, cores=2, frontend_cores=1)
    # The few-sequence rates of the 57M Mixtral here: one worker as fast as two -> the front end keeps its core.
    kept = choose_keeping_frontend(spec, cache_dir=tmp_path / "a", trial=trial_with({"kept": 475.0, "every": 474.0}),
                                   **common)
    assert kept["chosen"] == "colocated_1" and kept["layout"]["threads"] == 1 and kept["source"] == "measured"
    assert "1 core kept for the front end" in kept["summary"] and "--frontend-cores" in kept["summary"]
    assert kept["few_sequences"] == {"colocated_1 on 1 core": 475.0, "colocated_2 on 2 cores": 474.0}
    assert ("kept", online_layout.SMALL_BATCH) in calls and ("every", online_layout.SMALL_BATCH) in calls
    # The 108M Qwen3-MoE's: two processes 1.3x faster -> every core.
    every = choose_keeping_frontend(spec, cache_dir=tmp_path / "b", trial=trial_with({"kept": 263.0, "every": 348.0}),
                                    **common)
    assert every["chosen"] == "colocated_2" and "every core" in every["summary"]
    # Cached: the next start measures nothing.
    calls.clear()
    again = choose_keeping_frontend(spec, cache_dir=tmp_path / "b", trial=trial_with({"kept": 1.0, "every": 1.0}),
                                    **common)
    assert calls == [] and again["source"] == "cached" and again["chosen"] == "colocated_2"
    # No core kept: the every-core choice as before, no few-sequence trial.
    assert choose_keeping_frontend(spec, cache_dir=tmp_path / "b", trial=trial_with({}),
                                   **dict(common, frontend_cores=0))["chosen"] == "colocated_2"


def test_the_few_sequence_trial_alternates_its_runs_and_keeps_each_layouts_best(tiny_mixtral_dir, tmp_path) -> None:
    """One disturbed run does not decide: the few-sequence runs alternate (every core, kept, every core, kept) and
    each layout's best counts. Here the every-core layout's first run reads low (268, a tie with one process);
    its second (382) is the one that counts, so every core is taken."""
    spec = load_spec(tiny_mixtral_dir)
    small_runs = {"every": [268.0, 382.0], "kept": [269.0, 262.0]}
    order: list[str] = []

    def trial(layout, batch, prompt_len):
        if batch != online_layout.SMALL_BATCH:
            ep = layout.get("colocated") == 2 and not layout.get("replicated_experts")
            return {"tokens_per_s": 700.0 if ep else 300.0}
        name = "kept" if layout.get("colocated") == 1 and layout["threads"] == 1 else "every"
        order.append(name)
        return {"tokens_per_s": small_runs[name].pop(0)}

    choice = choose_keeping_frontend(spec, cache_dir=tmp_path, trial=trial, max_batch=64, max_model_len=256, cores=2,
                                     frontend_cores=1)
    assert order == ["every", "kept"] * online_layout.SMALL_BATCH_RUNS
    assert choice["chosen"] == "colocated_2" and "every core" in choice["summary"]
    assert choice["few_sequences"] == {"colocated_1 on 1 core": 269.0, "colocated_2 on 2 cores": 382.0}


def test_one_colocated_process_defaults_to_one_micro_batch() -> None:
    """`--colocated 1` has no exchange for a second micro-batch to hide (each would stream every expert once a
    step): it runs one unless `--micro-batches` says otherwise; more processes keep the default 2."""
    import argparse

    from mbridge_epoverlap.serving.cli.args import fill_layout_defaults

    def filled(**given):
        args = argparse.Namespace(attn_workers=None, expert_workers=None, micro_batches=None, colocated=0)
        vars(args).update(given)
        fill_layout_defaults(args)
        return args.micro_batches
    assert (filled(colocated=1), filled(colocated=2), filled(colocated=0)) == (1, 2, 2)
    assert filled(colocated=1, micro_batches=2) == 2 and filled(colocated=True) == 2


def test_one_process_splitting_its_expert_gemms_keeps_every_core_without_the_few_sequence_trial(
        tiny_mixtral_dir, tmp_path, monkeypatch) -> None:
    """Where one process on every core wins (its narrow steps share the tiled expert GEMMs, so the front end taking a
    core only leaves a helper's units to the caller), no core is kept for the front end and no 8-sequence trial
    runs; where its experts do not tile, the few-sequence trial still decides."""
    spec = load_spec(tiny_mixtral_dir)
    calls: list[str] = []
    table = {"colocated_2_replicated": 500.0, "colocated_2": 959.0, "disaggregated_1+1_m2": 619.0,
             "colocated_1": 854.0}
    monkeypatch.setattr(online_layout, "experts_tile", lambda spec: True)
    choice = choose_keeping_frontend(spec, frontend_cores=1, cores=2, max_batch=64, max_model_len=256,
                                     cache_dir=tmp_path / "a", trial=rates(spec, table, calls))
    assert choice["chosen"] == "colocated_1" and choice["layout"]["threads"] == 2 and len(calls) == 4
    assert "helper threads leave their work" in choice["summary"]
    monkeypatch.setattr(online_layout, "experts_tile", lambda spec: False)
    table = dict(table, colocated_1=1.4 * 959.0)
    calls.clear()

    def few(layout, batch, prompt_len):
        return {"tokens_per_s": 300.0} if batch == online_layout.SMALL_BATCH else rates(spec, table, calls)(
            layout, batch, prompt_len)
    choice = choose_keeping_frontend(spec, frontend_cores=1, cores=2, max_batch=64, max_model_len=256,
                                     cache_dir=tmp_path / "b", trial=few)
    assert choice["chosen"] == "colocated_1" and choice["layout"]["threads"] == 1  # the few-sequence trial kept one
