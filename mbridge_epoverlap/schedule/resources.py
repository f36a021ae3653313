"""Where each step of a schedule executes: streams that run steps in order, channels that carry collectives.

A schedule says *what* happens in which order; a `Resources` mapping says *where*. Training and
colocated serving put every step on one compute stream and every collective on one comm channel.
Disaggregated serving splits the same layer program over two kinds of workers: attention workers
run attention and the post-combine residual, expert workers run the experts, and the two directions
of the M2N transfer travel on separate links. Keeping this out of the step lists is what lets one
ordering be executed by the runtime and timed by the simulator unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from mbridge_epoverlap.schedule.program import Phase, Step


@dataclass(frozen=True)
class Resources:
    """A mapping from steps to streams and from COMM stages to channels.

    Attributes:
        default_stream: stream of any step not listed in `streams`.
        default_channel: channel of any COMM stage not listed in `channels`.
        streams: `(stage, phase) -> stream` for steps that run somewhere else than the default.
        channels: `stage -> channel` for collectives that use another channel than the default.
    """

    default_stream: str = "compute"
    default_channel: str = "comm"
    streams: Mapping[tuple[str, Phase], str] = field(default_factory=dict)
    channels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Frozen in spirit too: a shared module-level mapping must not be edited by one caller.
        object.__setattr__(self, "streams", MappingProxyType(dict(self.streams)))
        object.__setattr__(self, "channels", MappingProxyType(dict(self.channels)))

    def stream(self, step: Step) -> str:
        """The stream that executes `step` (runs it, issues it, or blocks on it)."""
        return self.streams.get((step.stage, step.phase), self.default_stream)

    def channel(self, stage: str) -> str:
        """The channel that carries the collective of COMM stage `stage`."""
        return self.channels.get(stage, self.default_channel)


# Training (combined 1F1B) and colocated serving: one compute stream, one comm channel.
TRAINING = Resources()
COLOCATED = Resources()

# Disaggregated serving (MegaScale-Infer): the attention worker runs attention and the residual after
# combine, issues dispatch and waits for combine; the expert worker waits for dispatch, runs the
# experts and issues combine. Each direction of the M2N transfer has its own link.
DISAGGREGATED = Resources(
    default_stream="attention",
    streams={
        ("dispatch", Phase.WAIT): "expert",
        ("experts", Phase.RUN): "expert",
        ("combine", Phase.ISSUE): "expert",
    },
    channels={"dispatch": "link_a2e", "combine": "link_e2a"},
)
