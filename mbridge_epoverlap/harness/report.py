"""The A/B report as a markdown table, in the skill card's shape (case | stable-window mean | relative)."""

from __future__ import annotations

from typing import Any


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 1.0:
        return f"{value:.2f} s"
    return f"{value * 1000:.1f} ms"


def fmt_bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def _loss_cell(case: dict[str, Any]) -> str:
    match = case.get("loss_match_baseline")
    if match is None:
        return "baseline"
    if match:
        return "bitwise"
    diff = case.get("loss_max_abs_diff")
    first = (case.get("loss_mismatch_iters") or ["?"])[0]
    return f"DIFFERS from iter {first}" + (f" (max {diff:.3g})" if diff is not None else "")


def markdown_table(results: dict[str, Any]) -> str:
    window = results.get("stable_window") or ["?", "?"]
    # The reference runtime also measures the communication the schedule left exposed.
    comm = any(case.get("comm_wait_s") is not None for case in results["cases"])
    header = (f"| case | stable-window mean (iters {window[0]}-{window[1]}) | relative | loss vs baseline "
              "| finite loss | skipped / NaN iters | peak mem | TFLOP/s/GPU |")
    header += " exposed comm / iter |" if comm else ""
    # A profiled A/B (--profile, -en, -pyp): the profile analyzer's figures from each case's traces.
    traced = any("comm_hidden_pct" in case for case in results["cases"])
    header += " comm hidden % (trace) | exposed comm / iter (trace) |" if traced else ""
    lines = [header, "|---|---|---|---|---|---|---|---|" + ("---|" if comm else "") + ("---|---|" if traced else "")]
    for case in results["cases"]:
        relative = case.get("relative")
        tflops = case.get("tflops_per_gpu")
        lines.append(
            f"| {case['name']} | {fmt_seconds(case.get('stable_mean_s'))} | "
            f"{'n/a' if relative is None else f'{relative:.3f}x'} | {_loss_cell(case)} | "
            f"{'yes' if case.get('finite_loss') else 'NO'} | {case.get('skipped_iters')} / {case.get('nan_iters')} | "
            f"{fmt_bytes(case.get('peak_mem_bytes'))} | {'n/a' if tflops is None else f'{tflops:.3g}'} |"
            + (f" {fmt_seconds(case.get('comm_wait_s'))} |" if comm else "")
            + (_trace_cells(case) if traced else ""))
    return "\n".join(lines) + "\n"


def prediction_table(results: dict[str, Any]) -> str:
    """Measured against the simulator fed each case's measured stage costs ("" when no case has them)."""
    cases = [c for c in results["cases"] if c.get("predicted")]
    if not cases:
        return ""
    lines = ["| case | measured step | predicted step | error | measured exposed comm | predicted exposed comm "
             "| comm hidden (measured, all ranks (worst rank) / predicted / upper bound) |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for case in cases:
        p = case["predicted"]
        measured_hidden, worst = p.get("measured_hidden_fraction"), case.get("comm_hidden_worst_rank")
        measured = "n/a" if measured_hidden is None else f"{measured_hidden:.0%}"
        measured += "" if worst is None else f" ({worst:.0%})"
        hidden = f"{measured} / {p['hidden_fraction']:.0%} / {p['hidden_upper_bound']:.0%}"
        lines.append(f"| {case['name']} | {fmt_seconds(case.get('stable_mean_s'))} | {fmt_seconds(p['step_s'])} | "
                     f"{p['error']:+.1%}{'' if p['within_tolerance'] else ' (off)'} | "
                     f"{fmt_seconds(case.get('comm_wait_s'))} | {fmt_seconds(p['exposed_comm_s'])} | {hidden} |")
        gap = p.get("largest_gap")
        if gap:
            notes.append(f"{case['name']}: the model gets `{gap['stall']}` most wrong: measured "
                         f"{fmt_seconds(gap['measured_s'])} per iteration, predicted "
                         f"{fmt_seconds(gap['predicted_s'])}")
    text = "\n".join(lines) + "\n"
    text += ("\nThe simulator runs each case's schedule with the stage costs the runtime measured in it (compute "
             "stages, each collective's time on the communication thread, the cost of issuing it); time outside "
             "the schedule (gradient all-reduce, optimizer) is added as measured. `comm hidden` measured: "
             "1 - exposed / collective time, from each rank's own account, summed over the ranks (the rank that hid "
             "least in parentheses). `upper bound`: the share any order of the same steps could hide with these "
             "costs.\n")
    if notes:
        text += "\n" + "\n".join(f"> off by more than 15 %: {n}" for n in notes) + "\n"
    return text


def _trace_cells(case: dict[str, Any]) -> str:
    hidden = case.get("comm_hidden_pct")
    return (f" {'n/a' if hidden is None else f'{hidden:.1f}'} | "
            f"{fmt_seconds(case.get('exposed_comm_per_iter_s'))} |")


def markdown_report(results: dict[str, Any]) -> str:
    """Title, context line, the table and the switches of each case."""
    env = results.get("environment") or {}
    machine = env.get("machine") or {}
    where = machine.get("hostname")
    context = [
        f"recipe {results.get('recipe')} ({results.get('task')})",
        f"gpu {results.get('gpu')} x {results.get('num_gpus')}",
        f"{results.get('max_steps')} steps",
        f"{results.get('repeats')} repeat(s), interleaved",
    ]
    if where:
        flags = machine.get("cpu_flags")
        flag_text = f", flags {' '.join(flags) if flags else 'none of avx2/avx512f/avx512_bf16/amx_bf16'}" \
            if flags is not None else ""
        context.append(f"on {where} ({machine.get('cpus')} CPUs{flag_text})")
    precision = env.get("compute_dtype")
    if isinstance(precision, dict) and precision.get("reason"):
        context.append(f"computed in {precision['reason']}")
    lines = [f"## A/B: {results.get('ab') or 'single run'}", "", "; ".join(context), "",
             markdown_table(results).rstrip()]
    predicted = prediction_table(results)
    if predicted:
        lines += ["", "### Simulator against the measurement", "", predicted.rstrip()]
    switched = [c for c in results["cases"] if c.get("overrides")]
    if switched:
        lines.append("")
        for case in switched:
            lines.append(f"- `{case['name']}`: " + ", ".join(f"`{o}`" for o in case["overrides"]))
    notes = list(results.get("warnings") or [])
    for case in results["cases"]:
        if not case.get("losses_repeat_consistent", True):
            notes.append(f"{case['name']}: losses differ between repeats (non-deterministic run)")
    if notes:
        lines.append("")
        lines += [f"> note: {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"
