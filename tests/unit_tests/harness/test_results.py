"""Stable windows, medians across repeats, bitwise loss match, the results files."""

from __future__ import annotations

import json
import math

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness.experiment import CaseRecord, Experiment
from mbridge_epoverlap.harness.results import REQUIRED_CASE_KEYS, atomic_write, build_results, write_outputs
from mbridge_epoverlap.harness.stats import (
    Window,
    clip_window,
    loss_mismatches,
    median_by_iteration,
    parse_window,
    window_mean,
)
from mbridge_epoverlap.runtime.metrics import RunMetrics


def experiment(tmp_path, names=("off", "on"), repeats=1, window=Window(3, 8), max_steps=10, flops=None):
    return Experiment(
        recipe="qwen3_30b_a3b", task="pretrain", gpu="cpu", num_gpus=2, gpus_per_node=2, environment={},
        cases=[CaseRecord(n, [f"x.{n}=true"], model_flops_per_iteration=flops) for n in names], repeats=repeats,
        max_steps=max_steps, window=window, results_json=str(tmp_path / "r.json"))


def run(times, losses=None, **kw):
    return RunMetrics(step_times_s=list(times), losses=list(losses or [1.0] * len(times)), **kw)


def test_parse_and_clip_window():
    assert parse_window("3:8") == Window(3, 8)
    assert clip_window(Window(3, 8), 10) == (Window(3, 8), None)
    clipped, warning = clip_window(Window(3, 8), 5)
    assert clipped == Window(3, 5) and "3:8" in warning
    assert clip_window(Window(3, 8), 2)[0] == Window(2, 2)


@pytest.mark.parametrize(("bad", "message"), [("3", "is not START:END"), ("8:3", "need 1 <= START <= END"),
                                              ("0:5", "need 1 <= START <= END"), ("a:b", "is not START:END")])
def test_parse_window_names_the_flag_and_the_form(bad, message):
    with pytest.raises(UsageError, match=f"^--stable_window '{bad}':? {message}.*e.g. 3:8"):
        parse_window(bad)


def test_median_by_iteration_and_window_mean():
    its, med = median_by_iteration([run([1, 2, 3]), run([3, 2, 1]), run([2, 2, 2])])
    assert its == [1, 2, 3] and med == [2, 2, 2]
    assert window_mean([1, 2, 3, 4], [9, 1, 2, 3], Window(2, 3)) == 1.5
    assert window_mean([1, 2], [1, 1], Window(5, 6)) is None


def test_loss_match_is_bitwise():
    a = [2.5, 1.0, 0.1 + 0.2]
    assert loss_mismatches(a, list(a)) == []
    assert loss_mismatches(a, [2.5, 1.0, 0.3]) == [3]  # 0.1 + 0.2 != 0.3 in the last bit
    assert loss_mismatches([0.0], [-0.0]) == [1]
    assert loss_mismatches([math.nan], [math.nan]) == []
    assert loss_mismatches([1.0, 2.0], [1.0]) == [2]


def test_build_results_speedup_and_health(tmp_path):
    exp = experiment(tmp_path, repeats=2)
    runs = {
        "off": [run([5, 4] + [2.0] * 8, peak_mem_bytes=100), run([5, 4] + [2.2] * 8, peak_mem_bytes=120)],
        "on": [run([5, 4] + [1.0] * 8, peak_mem_bytes=110), run([5, 4] + [1.0] * 8)],
    }
    res = build_results(exp, runs)
    off, on = res["cases"]
    for key in REQUIRED_CASE_KEYS:
        assert key in off and key in on
    assert off["stable_mean_s"] == pytest.approx(2.1) and on["stable_mean_s"] == pytest.approx(1.0)
    assert off["relative"] == pytest.approx(1.0) and on["relative"] == pytest.approx(2.1)
    assert on["loss_match_baseline"] is True and off["loss_match_baseline"] is None
    assert off["peak_mem_bytes"] == 120 and on["finite_loss"] is True
    assert off["stable_window"] == [3, 8] and len(off["losses"]) == 10
    assert {"recipe", "task", "gpu", "num_gpus", "environment", "cases"} <= set(res)


def test_nonfinite_losses_and_mismatch(tmp_path):
    exp = experiment(tmp_path)
    res = build_results(exp, {"off": [run([1.0] * 10, [1.0] * 10)],
                              "on": [run([1.0] * 10, [1.0] * 9 + [math.nan], nan_iters=1)]})
    on = res["cases"][1]
    assert on["finite_loss"] is False and on["nan_iters"] == 1
    assert on["loss_match_baseline"] is False and on["loss_mismatch_iters"] == [10]


def test_tflops_prefers_trainer_steps_then_estimate(tmp_path):
    exp = experiment(tmp_path, flops=4e12)
    res = build_results(exp, {"off": [run([2.0] * 10)],
                              "on": [run([1.0] * 10, tflops_per_step=[5.0] * 10)]})
    assert res["cases"][0]["tflops_per_gpu"] == pytest.approx(1.0)  # 4e12 / 2 s / 2 GPUs
    assert res["cases"][0]["tflops_source"] == "model_flops_estimate"
    assert res["cases"][1]["tflops_per_gpu"] == 5.0


def test_write_outputs(tmp_path):
    exp = experiment(tmp_path)
    res = build_results(exp, {"off": [run([2.0] * 10)], "on": [run([1.0] * 10, [1.0] * 9 + [math.inf])]})
    paths = write_outputs(res, tmp_path / "r.json")
    data = json.loads(paths["json"].read_text())  # strict JSON: the infinite loss became null
    assert data["cases"][1]["losses"][-1] is None
    assert paths["markdown"].read_text().count("| on |") == 1
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md", "r.png"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="^boom$"):
        atomic_write(target, fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_exposed_communication_is_carried_into_results_and_table(tmp_path):
    from mbridge_epoverlap.harness.report import markdown_table

    exp = experiment(tmp_path, repeats=2)
    runs = {
        "off": [run([2.0] * 10, comm_step_s=[0.5] * 10, comm_cpu_s=[0.1] * 10),
                run([2.0] * 10, comm_step_s=[0.7] * 10, comm_cpu_s=[0.3] * 10)],
        "on": [run([1.0] * 10, comm_step_s=[0.0] * 2 + [0.2] * 8, comm_cpu_s=[0.1] * 10)] * 2,
    }
    res = build_results(exp, runs)
    off, on = res["cases"]
    assert off["comm_wait_s"] == pytest.approx(0.6) and off["comm_cpu_s"] == pytest.approx(0.2)
    assert on["comm_wait_s"] == pytest.approx(0.2)  # iterations 3-8 only
    table = markdown_table(res)
    assert table.splitlines()[0].endswith("| exposed comm / iter |")
    assert "| 600.0 ms |" in table.splitlines()[2] and table.splitlines()[3].endswith("| 200.0 ms |")
    # Results of GPU runs and logs carry no such figure: no column.
    plain = build_results(exp, {name: [run(r.step_times_s) for r in rs] for name, rs in runs.items()})
    assert plain["cases"][0]["comm_wait_s"] is None and "exposed comm" not in markdown_table(plain)
    # The runtime's JSON round-trips the series.
    m = RunMetrics.from_dict({"step_times_s": [1], "losses": [1.0], "comm_step_s": [0.25], "comm_cpu_s": [0.5]})
    assert (m.comm_step_s, m.comm_cpu_s) == ([0.25], [0.5])


def test_metrics_from_runtime_dict():
    m = RunMetrics.from_dict({"step_times_s": [1, 2], "losses": [3.0, None], "skipped_iters": 0, "nan_iters": 1,
                              "peak_mem_bytes": 10, "tflops_per_gpu": None, "trace_dir": None, "extra": 1})
    assert m.step_times_s == [1.0, 2.0] and math.isnan(m.losses[1]) and m.iteration_numbers() == [1, 2]


def test_experiment_round_trip(tmp_path):
    exp = experiment(tmp_path, names=("a", "b", "c"), repeats=2)
    assert exp.run_order() == [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2), ("c", 2)]
    exp.save(tmp_path / "plan.json")
    assert Experiment.load(tmp_path / "plan.json") == exp


def test_prediction_from_the_measured_stage_costs(tmp_path):
    from mbridge_epoverlap.harness.report import markdown_report
    from mbridge_epoverlap.schedule.costs import training_costs
    from mbridge_epoverlap.schedule.predict import predict

    schedule = {"micro_batches": 4, "layers": 2, "overlap": True, "delay_wgrad": False}
    costs = {**training_costs(0.002, 0.003, 0.0015, t_post=0.0005),
             **{f"{n}.{p}": 0.0001 for n in ("dispatch", "combine", "combine_bwd", "dispatch_bwd")
                for p in ("issue", "wait")}}
    makespan = predict(schedule, costs).schedule_s
    stage_s = {name: [value] * 10 for name, value in costs.items()}

    def measured(schedule_time, wait_extra=0.0):  # 50 ms per step outside the schedule
        series = {**stage_s, "dispatch_bwd.wait": [costs["dispatch_bwd.wait"] + wait_extra] * 10}
        return run([schedule_time + 0.05] * 10, comm_step_s=[0.01] * 10, schedule_s=[schedule_time] * 10,
                   stage_s=series, schedule=schedule)

    exp = experiment(tmp_path)
    # "on" ran 50 % slower than its stage costs say, and waited longer on dispatch_bwd.
    res = build_results(exp, {"off": [measured(makespan)], "on": [measured(1.5 * makespan, 0.01)]})
    off, on = res["cases"]
    assert off["predicted"]["error"] == pytest.approx(0.0, abs=1e-9) and off["predicted"]["within_tolerance"]
    assert off["predicted"]["largest_gap"] is None
    assert off["stage_costs_s"]["attn"] == pytest.approx(0.002) and off["schedule"] == schedule
    assert on["predicted"]["error"] < -0.15 and not on["predicted"]["within_tolerance"]
    assert on["predicted"]["largest_gap"]["stall"] == "dispatch_bwd.wait"
    text = markdown_report(res)
    assert "### Simulator against the measurement" in text and "(off)" in text
    assert "the model gets `dispatch_bwd.wait` most wrong" in text
    # Runs without stage costs (GPU jobs, logs) get no prediction and no table.
    plain = build_results(exp, {"off": [run([1.0] * 10)], "on": [run([1.0] * 10)]})
    assert plain["cases"][0]["predicted"] is None and "Simulator" not in markdown_report(plain)
    back = RunMetrics.from_dict(measured(1.0).to_dict())
    assert back.stage_s == stage_s | {"dispatch_bwd.wait": back.stage_s["dispatch_bwd.wait"]}
    assert back.schedule == schedule
