"""Draw a timeline as a Gantt chart (PNG), one row per resource.

matplotlib is imported here, inside the function, with the Agg backend: drawing must work on a
machine without a display and must not slow down importing the package.
"""

from __future__ import annotations

from pathlib import Path

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.program import WEIGHT_GRADIENT_STAGES
from mbridge_epoverlap.schedule.timeline import Timeline

# One colour per stage family; backward stages reuse their forward colour with a hatch.
_COLOURS = {
    "attn": "#4C72B0",
    "dispatch": "#DD8452",
    "experts": "#55A868",
    "combine": "#C44E52",
    "post": "#8172B3",
}
_FAMILY = {
    "attn_dgrad": "attn",
    "attn_wgrad": "attn",
    "experts_dgrad": "experts",
    "experts_wgrad": "experts",
    "experts_wgrad_down": "experts",
    "dispatch_bwd": "dispatch",
    "combine_bwd": "combine",
    "post_bwd": "post",
}


def save_gantt(timeline: Timeline, path: str | Path, *, title: str | None = None, unit: str = "") -> Path:
    """Write `timeline` as a PNG Gantt chart to `path` and return the path.

    Each bar is one event, labelled with its micro-batch (and layer when there is room); wgrad
    stages are cross-hatched, other backward stages striped.

    Args:
        timeline: what `simulate` returned.
        path: output file; parent folders are created.
        title: chart title; defaults to the timeline's one-line summary.
        unit: time unit for the x axis label (e.g. "ms").

    Raises:
        UsageError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    resources = list(timeline.resources)
    span = timeline.makespan or 1.0
    fig_height = max(2.4, 1.0 + 0.6 * len(resources))
    fig, ax = plt.subplots(figsize=(12, fig_height))
    rows = {name: index for index, name in enumerate(reversed(resources))}
    for event in timeline.events:
        if event.duration <= 0:
            continue
        family = _FAMILY.get(event.stage, event.stage)
        hatch = "xx" if event.stage in WEIGHT_GRADIENT_STAGES else ("//" if event.stage in _FAMILY else None)
        ax.barh(
            rows[event.resource],
            event.duration,
            left=event.start,
            height=0.7,
            color=_COLOURS.get(family, "#999999"),
            edgecolor="black",
            linewidth=0.4,
            hatch=hatch,
        )
        # Label only bars wide enough to hold the text; narrow bars would become unreadable smudges.
        share = event.duration / span
        if share > 0.012:
            label = f"{event.micro_batch}" if share < 0.035 else f"{event.micro_batch}.L{event.layer}"
            ax.text(
                event.start + event.duration / 2, rows[event.resource], label, ha="center", va="center", fontsize=7
            )
    ax.set_yticks(list(rows.values()), list(rows.keys()))
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(f"time ({unit})" if unit else "time")
    ax.set_title(title if title is not None else timeline.summary(), fontsize=9)
    used = {_FAMILY.get(e.stage, e.stage) for e in timeline.events if e.duration > 0}
    handles = [Patch(color=c, label=name) for name, c in _COLOURS.items() if name in used]
    if any(e.stage in _FAMILY for e in timeline.events):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="backward"))
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="xx", label="wgrad"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UsageError(
            f"cannot write the Gantt chart to {path}: {exc.strerror}; pass a writable --png path"
        ) from None
    finally:
        plt.close(fig)
    return path
