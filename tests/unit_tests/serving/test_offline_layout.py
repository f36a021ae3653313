"""`serve --prompts` without layout flags measures its layout (`serving.engine.choice.offline`): a trial run of each
candidate on the batch's own prompts, the batch's time predicted from the trial's prefill and decode step, the
fastest taken (one thread per process unless more threads win by the margin), the choice cached per batch shape."""

from __future__ import annotations

import json

import pytest

from mbridge_epoverlap.serving.engine.choice import offline, online
from mbridge_epoverlap.serving.engine.choice.layout import THREADS_MARGIN
from mbridge_epoverlap.serving.engine.choice.offline import choose_offline_layout, predict
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.workers.requests import Request


def _requests(count: int, length: int) -> list[Request]:
    return [Request(f"r{i}", tuple(range(3, 3 + length))) for i in range(count)]


def _trials(spec, table: dict[str, tuple[float, float]], calls: list[str]):
    """A trial answering (prefill ms, decode step ms) per candidate (the candidates on 2 cores)."""
    options = online.candidates(spec, 2)

    def trial(layout, sample):
        name = next(n for n, option in options.items() if option == layout)
        calls.append((name, len(sample)))
        prefill, step = table[name]
        return {"ttft_ms_p50": prefill, "tbt_ms_p50": step}
    return trial


def test_the_batch_time_is_rounds_of_one_prefill_and_the_decode_steps():
    figures = predict({"ttft_ms_p50": 200.0, "tbt_ms_p50": 50.0}, requests=96, rounds=3, max_new_tokens=11)
    assert figures["predicted_s"] == pytest.approx(3 * (0.2 + 10 * 0.05))
    assert figures["tokens_per_s"] == pytest.approx(96 * 11 / 2.1, rel=1e-3)
    assert predict({"ttft_ms_p50": 200.0, "tbt_ms_p50": None}, requests=1, rounds=1, max_new_tokens=4)[
        "tokens_per_s"] == 0.0  # no decode step measured: never the choice


def test_the_trial_decodes_at_the_mean_context_and_its_prefill_is_scaled_back():
    sample = [Request("a", (5, 6, 7)), Request("b", (9,) * 10)]
    longer = offline.at_mean_context(sample, max_new_tokens=10)  # half of 10, within 10 - 9 trial tokens: 1
    assert [r.prompt_ids for r in longer] == [(5, 6, 7, 5), (9,) * 11]
    longer = offline.at_mean_context(sample, max_new_tokens=64)
    assert longer[0].prompt_ids[:7] == (5, 6, 7, 5, 6, 7, 5) and len(longer[0].prompt_ids) == 3 + 32
    assert offline.at_mean_context(sample, max_new_tokens=4) == sample  # no room past the trial's own steps
    figures = predict({"ttft_ms_p50": 300.0, "tbt_ms_p50": 50.0}, requests=2, rounds=1, max_new_tokens=3,
                      prefill_share=0.5)
    assert figures["prefill_s"] == pytest.approx(0.15) and figures["predicted_s"] == pytest.approx(0.25)


def test_the_layout_that_finishes_the_batch_first_wins_and_the_choice_is_cached(tiny_mixtral_dir, tmp_path,
                                                                                monkeypatch):
    spec = load_spec(tiny_mixtral_dir)
    monkeypatch.setattr(offline, "experts_tile", lambda spec: False)  # colocated_1's every op on OpenMP threads
    calls: list = []
    # A cheap prefill does not make up for a slow decode step over 64 new tokens; the reverse holds over 2.
    table = {"colocated_2_replicated": (900.0, 30.0), "colocated_2": (300.0, 60.0),
             "disaggregated_1+1_m2": (400.0, 45.0), "colocated_1": (500.0, 50.0)}
    long_run = choose_offline_layout(spec, _requests(40, 20), max_new_tokens=64, max_batch=16, cores=2,
                                     cache_dir=tmp_path, trial=_trials(spec, table, calls))
    assert long_run["chosen"] == "colocated_2_replicated" and long_run["source"] == "measured"
    assert long_run["batch"] == 16 and {n for n, size in calls} == set(table) and {s for _, s in calls} == {16}
    rates = {n: c["tokens_per_s"] for n, c in long_run["candidates"].items()}
    assert max(rates, key=rates.__getitem__) == long_run["chosen"]
    # The runner-up (disaggregated) 1.34x slower: past the contest margin, one trial each.
    assert len(calls) == 4 and "trials" not in long_run["candidates"]["colocated_2_replicated"]
    assert all(name in long_run["summary"] for name in table)
    short_run = choose_offline_layout(spec, _requests(40, 20), max_new_tokens=2, max_batch=16, cores=2,
                                      cache_dir=tmp_path, trial=_trials(spec, table, calls))
    assert short_run["chosen"] == "colocated_2"
    # The same batch shape again: the cached choice, no trial.
    calls.clear()
    again = choose_offline_layout(spec, _requests(40, 24), max_new_tokens=64, max_batch=16, cores=2,
                                  cache_dir=tmp_path, trial=_trials(spec, table, calls))
    assert again["source"] == "cached" and again["chosen"] == "colocated_2_replicated" and calls == []
    # Two OpenMP threads in one process must win by the margin.
    table["colocated_1"] = (900.0, 30.0 / 1.2)
    margin = choose_offline_layout(spec, _requests(8, 20), max_new_tokens=64, max_batch=8, cores=2,
                                   cache_dir=tmp_path, trial=_trials(spec, table, calls))
    assert margin["chosen"] == "colocated_2_replicated" and "not 1.3x faster" in margin["summary"]
    assert choose_offline_layout(spec, _requests(8, 20), max_new_tokens=4, max_batch=8, cores=1,
                                 cache_dir=tmp_path)["source"] == "only"


def test_a_close_contest_is_tried_again_and_the_faster_trial_of_each_kept(tiny_mixtral_dir, tmp_path, monkeypatch):
    """One trial on a shared machine can read slow: the two best within `CONTEST_MARGIN` run again (A B A B)."""
    spec = load_spec(tiny_mixtral_dir)
    monkeypatch.setattr(offline, "experts_tile", lambda spec: True)  # colocated_1's steps split the tiled GEMMs
    first = {"colocated_2_replicated": (900.0, 80.0), "colocated_2": (300.0, 60.0),  # disturbed: reads slow once
             "disaggregated_1+1_m2": (400.0, 90.0), "colocated_1": (300.0, 50.0)}
    calls: list = []
    seen: set[str] = set()

    def trial(layout, sample):
        name = next(n for n, option in online.candidates(spec, 2).items() if option == layout)
        calls.append(name)
        prefill, step = first[name] if name not in seen else (300.0, 40.0 if name == "colocated_2" else 50.0)
        seen.add(name)
        return {"ttft_ms_p50": prefill, "tbt_ms_p50": step}

    choice = choose_offline_layout(spec, _requests(16, 20), max_new_tokens=32, max_batch=16, cores=2,
                                   cache_dir=tmp_path, trial=trial)
    assert calls[4:] == ["colocated_2", "colocated_1"] and choice["chosen"] == "colocated_2"
    assert choice["candidates"]["colocated_2"]["decode_step_ms"] == 40.0
    # Far apart: one trial each.
    calls.clear()
    first["colocated_1"] = (300.0, 10.0)
    seen.clear()
    assert choose_offline_layout(spec, _requests(16, 20), max_new_tokens=64, max_batch=16, cores=2,
                                 cache_dir=tmp_path, trial=trial)["chosen"] == "colocated_1" and len(calls) == 4


def test_serve_without_layout_flags_runs_the_layout_its_trials_measured_fastest(tiny_mixtral_dir, prompts,
                                                                               hf_greedy, tmp_path, capsys,
                                                                               monkeypatch):
    """Real trial runs of every candidate on the tiny model: the run takes the one its trials predict fastest,
    says so in the JSON and on stderr, decodes `transformers`' tokens, and the next run reuses the choice."""
    from mbridge_epoverlap.cli import main

    monkeypatch.setattr(online, "cache_path", lambda cache_dir: tmp_path / "layouts.json")
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    argv = ["serve", "--checkpoint", str(tiny_mixtral_dir), "--prompts", str(path), "--max-new-tokens", "3", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result, choice = json.loads(captured.out), json.loads(captured.out)["layout_choice"]
    assert choice["source"] == "measured" and "layout trial 1/" in captured.err
    assert "layout (measured; no layout flag given" in captured.err
    rated = {n: c["tokens_per_s"] / (THREADS_MARGIN if c["layout"]["threads"] > 1 and not
                                     offline.experts_tile(load_spec(tiny_mixtral_dir)) else 1.0)
             for n, c in choice["candidates"].items()}
    assert choice["chosen"] == max(rated, key=rated.__getitem__) and len(rated) >= 3
    assert all(c["tokens_per_s"] > 0 and c["decode_step_ms"] > 0 for c in choice["candidates"].values())
    assert result["threads_per_process"] == choice["layout"]["threads"]
    assert result["mode"] == ("colocated" if "colocated" in choice["layout"] else "disaggregated")
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, 3)
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["layout_choice"]["source"] == "cached" and "layout trial" not in captured.err
    assert "measured before on this machine, cached" in captured.err
