"""Reading Megatron-Bridge training logs, and `--from_logs` turning them into the same results."""

from __future__ import annotations

import json
import math

import pytest

from mbridge_epoverlap.harness.main import main
from mbridge_epoverlap.harness.mbridge_logs import LogParseError, parse_log_file, parse_log_text


def iteration_line(it: int, total: int, ms: float, loss: float, skipped: int = 0, nans: int = 0,
                   prefix: str = "pretrain_qwen/0 ") -> str:
    return (f"{prefix}[2026-01-05 10:00:{it:02d}] iteration {it:>8}/{total:>8} | consumed samples: {it * 1024:>12} | "
            f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 3.000000E-04 | global batch size:  1024 | "
            f"lm loss: {loss:.6E} | load_balancing_loss: 1.000000E+00 | loss scale: 1.0 | grad norm: 0.421 | "
            f"number of skipped iterations: {skipped:>3} | number of nan iterations: {nans:>3} |")


def bridge_log(step_s: list[float], losses: list[float], tflops: list[float], mem_mb: float = 63660.5) -> str:
    lines = ["Setting up model ...", "training ..."]
    for i, (t, loss, tf) in enumerate(zip(step_s, losses, tflops, strict=True), start=1):
        lines.append(f"pretrain_qwen/0 Step Time : {t:.2f}s GPU utilization: {tf:.1f}MODEL_TFLOP/s/GPU")
        lines.append(iteration_line(i, len(step_s), t * 1000, loss))
        if i == 1:
            lines.append(f"[Rank 0] (after 1 iterations) memory (MB) | allocated: 20480.0 | max allocated: {mem_mb} | "
                         "reserved: 70000.0 | max reserved: 70000.0")
    return "\n".join(lines) + "\n"


def test_iteration_lines_give_times_losses_and_tflops():
    m = parse_log_text(bridge_log([50.0, 30.0, 24.7, 24.7], [11.9, 10.2, 9.5, 9.1], [120.0, 200.0, 244.0, 244.1]))
    assert m.step_times_s == [50.0, 30.0, 24.7, 24.7]
    assert m.losses == [11.9, 10.2, 9.5, 9.1]
    assert m.iterations == [1, 2, 3, 4]
    assert m.tflops_per_step == [120.0, 200.0, 244.0, 244.1]
    assert m.peak_mem_bytes == int(63660.5 * 1024 * 1024)
    assert (m.skipped_iters, m.nan_iters) == (0, 0)


def test_megatron_only_log_with_interval_and_health_counters():
    text = "\n".join([iteration_line(5, 20, 2000.0, 8.0), iteration_line(10, 20, 1900.0, math.nan, nans=2),
                      iteration_line(15, 20, 1800.0, 7.5, skipped=1), "some other line"])
    m = parse_log_text(text)
    assert m.iterations == [5, 10, 15] and m.step_times_s == [2.0, 1.9, 1.8]
    assert math.isnan(m.losses[1]) and (m.skipped_iters, m.nan_iters) == (1, 2)
    assert m.tflops_per_step is None and m.peak_mem_bytes is None


def test_step_time_lines_alone():
    m = parse_log_text("Step Time : 9.09s GPU utilization: 663.5MODEL_TFLOP/s/GPU\n"
                       "Step Time : 9.01s GPU utilization: 665.0MODEL_TFLOP/s/GPU\n")
    assert m.step_times_s == [9.09, 9.01] and m.tflops_per_step == [663.5, 665.0]


def test_repeated_iterations_keep_the_last_complete_record():
    text = "\n".join([iteration_line(1, 2, 1000.0, 5.0), iteration_line(2, 2, 900.0, 4.0),
                      iteration_line(1, 2, 1100.0, 5.0), iteration_line(2, 2, 950.0, 4.0)])
    assert parse_log_text(text).step_times_s == [1.1, 0.95]


def test_no_iterations(tmp_path):
    with pytest.raises(LogParseError, match="no training iterations"):
        parse_log_text("Traceback (most recent call last):\nRuntimeError: NCCL error\n", "job.log")
    with pytest.raises(LogParseError, match="cannot read"):
        parse_log_file(tmp_path / "missing.log")


def test_from_logs_reports_like_a_local_ab(tmp_path, capsys):
    losses = [11.9, 10.2, 9.5, 9.1, 8.8, 8.6, 8.4, 8.3, 8.2, 8.1]
    off = tmp_path / "off.log"
    on = tmp_path / "on.log"
    off.write_text(bridge_log([41.25] * 10, losses, [240.0] * 10))
    on.write_text(bridge_log([31.31] * 10, losses, [287.0] * 10))
    out = tmp_path / "ab" / "cluster.json"
    rc = main(["--from_logs", f"ep_overlap_off={off}", f"ep_overlap_on={on}", "-g", "h100", "-ng", "16",
               "-mr", "qwen3_30b_a3b", "--results_json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    off_case, on_case = data["cases"]
    assert [c["name"] for c in data["cases"]] == ["ep_overlap_off", "ep_overlap_on"]
    assert on_case["relative"] == pytest.approx(41.25 / 31.31)
    assert on_case["loss_match_baseline"] is True and on_case["tflops_per_gpu"] == pytest.approx(287.0)
    assert data["gpu"] == "h100" and data["num_gpus"] == 16 and data["stable_window"] == [3, 8]
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
    assert "| ep_overlap_on | 31.31 s | 1.317x | bitwise |" in capsys.readouterr().out


def test_from_logs_repeats_and_bad_input(tmp_path, capsys):
    a = tmp_path / "a.log"
    a.write_text(bridge_log([2.0] * 4, [1.0] * 4, [1.0] * 4))
    out = tmp_path / "rep.json"
    assert main(["--from_logs", f"x={a}", f"y={a}", f"x={a}", f"y={a}", "--results_json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["repeats"] == 2 and data["cases"][0]["repeats"] == 2
    assert "does not fit" in capsys.readouterr().err  # default window 3:8 clipped to 4 iterations
    bad = tmp_path / "bad.log"
    bad.write_text("nothing here\n")
    missing_out = tmp_path / "none.json"
    assert main(["--from_logs", f"x={bad}", "--results_json", str(missing_out)]) == 2
    assert main(["--from_logs", f"x={tmp_path / 'nope.log'}", "--results_json", str(missing_out)]) == 2
    assert not missing_out.exists()


def test_from_logs_exit_status_follows_the_losses(tmp_path, capsys):
    losses = [9.0, 8.5, 8.25, 8.0]
    off, on, diverged = tmp_path / "off.log", tmp_path / "on.log", tmp_path / "nan.log"
    off.write_text(bridge_log([2.0] * 4, losses, [1.0] * 4))
    on.write_text(bridge_log([1.5] * 4, [9.0, 8.5, 8.25, 8.000001], [1.0] * 4))
    diverged.write_text(bridge_log([1.5] * 4, [9.0, 8.5, math.nan, math.nan], [1.0] * 4))
    out = tmp_path / "r.json"
    pair = ["--from_logs", f"ep_overlap_off={off}", f"ep_overlap_on={on}", "--stable_window", "2:4",
            "--results_json", str(out)]
    # GPU schedules may sum in another order: a differing loss is reported, the status stays 0.
    assert main([*pair, "-g", "h100"]) == 0
    err = capsys.readouterr().err
    assert "warning: ep_overlap_on: losses differ from ep_overlap_off from iteration 4" in err
    # The reference runtime is bitwise exact: the same difference is an error there, results still written.
    out.unlink()
    assert main([*pair, "-g", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "error: ep_overlap_on: losses differ" in err and "bug" in err
    assert out.exists() and out.with_suffix(".md").exists()
    # A diverged case is an error on any target.
    assert main(["--from_logs", f"ep_overlap_off={off}", f"ep_overlap_on={diverged}", "-g", "h100",
                 "--stable_window", "2:4", "--results_json", str(out)]) == 1
    assert "error: ep_overlap_on: non-finite loss" in capsys.readouterr().err
