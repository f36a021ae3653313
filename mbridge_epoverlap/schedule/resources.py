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

from mbridge_epoverlap.schedule.program import BACKWARD_STAGES, FORWARD_STAGES, Kind, Phase, Role, Step, stage_steps


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
COLOCATED_RESOURCES = Resources()
# Training with the backward all-to-alls on a channel of their own (the CPU runtime's default): a forward
# collective never queues behind a backward one, nor the other way round.
TRAINING_TWO_CHANNELS = Resources(channels={stage.name: "comm_bwd" for stage in BACKWARD_STAGES
                                            if stage.kind is Kind.COMM})


def training_resources(comm_channels: int) -> Resources:
    """`TRAINING` for one communication channel, `TRAINING_TWO_CHANNELS` for two."""
    if comm_channels not in (1, 2):
        raise ValueError(f"comm_channels must be 1 or 2, got {comm_channels!r}")
    return TRAINING if comm_channels == 1 else TRAINING_TWO_CHANNELS

# Disaggregated serving (MegaScale-Infer): each step runs on the worker kind the stage table gives it
# (attention and the residual after combine on attention workers, the experts on expert workers; a
# transfer is issued by its sender and waited by its receiver). Each direction of the M2N transfer
# has its own link, named after its ends (link_a2e, link_e2a).
def _disaggregated() -> Resources:
    streams = {(step.stage, step.phase): step.role.value for stage in FORWARD_STAGES
               for step in stage_steps(0, 0, stage) if step.role is not Role.ATTENTION}
    channels = {stage.name: f"link_{stage.role.value[0]}2{stage.to_role.value[0]}" for stage in FORWARD_STAGES
                if stage.kind is Kind.COMM and stage.to_role is not None}
    return Resources(default_stream=Role.ATTENTION.value, streams=streams, channels=channels)


DISAGGREGATED_RESOURCES = _disaggregated()
