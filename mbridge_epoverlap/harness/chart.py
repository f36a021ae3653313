"""Step time per iteration per case, with the stable window shaded (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_chart(results: dict[str, Any], path: Path) -> None:
    """Draw the chart into `path` (PNG whatever the file name)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters and CI; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    try:
        window = results.get("stable_window")
        if window:
            ax.axvspan(window[0] - 0.5, window[1] + 0.5, color="0.9", label=f"stable window {window[0]}-{window[1]}")
        for case in results["cases"]:
            times = case.get("step_times_s") or []
            iterations = case.get("iterations") or list(range(1, len(times) + 1))
            label = case["name"]
            if case.get("relative"):
                label += f" ({case['relative']:.3f}x)"
            ax.plot(iterations, times, marker="o", markersize=3, linewidth=1.2, label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("iteration")
        ax.set_ylabel("step time (s, median over repeats)")
        ax.set_title(f"{results.get('recipe')} on {results.get('gpu')} x {results.get('num_gpus')}")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
