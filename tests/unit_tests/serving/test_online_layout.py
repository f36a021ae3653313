"""`serve --http` without layout flags measures its layout (`serving.engine.choice.online`): trial runs of the
candidates with requests joining at every step, the fastest taken (one thread per process unless more threads win
by the margin), replicated experts only where memory allows, and the choice cached per model, dtype, batch, cores
and CPU so that the next start reuses it. The trial runs are replaced by given rates here (`trial`);
`frontend/test_server_life.py::test_a_server_without_layout_flags_measures_its_layout` starts a real one."""

from __future__ import annotations

import json

from mbridge_epoverlap.serving.engine.choice import online as online_layout
from mbridge_epoverlap.serving.engine.choice.online import candidates, choose_online_layout, expert_bytes
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


def test_the_fastest_trial_wins_and_is_said(tiny_mixtral_dir, tmp_path) -> None:
    spec = load_spec(tiny_mixtral_dir)
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


def test_the_choice_is_cached_per_model_batch_and_cores(tiny_mixtral_dir, tmp_path) -> None:
    spec = load_spec(tiny_mixtral_dir)
    calls: list[str] = []
    table = {"colocated_2_replicated": 600.0, "colocated_2": 800.0, "disaggregated_1+1_m2": 500.0,
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
