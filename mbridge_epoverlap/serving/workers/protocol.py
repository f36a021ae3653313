"""The serving workers' protocol: their M2N messages and tags, and what a worker and a transport offer.

`Worker` is what every worker offers the process that runs it; `Transport` is what an attention worker asks of
the transport that carries its tokens to the experts and back.

Messages are typed records with `encode()` (the tensors sent, one M2N message) and `decode(tensors)`; their
wire forms are defined here and nowhere else:

- `Dispatch`, attention -> expert: `[control, tokens [u, h], token_index int64[n], expert_ids int64[n]]` for the
  n (token, slot) pairs routed to that expert worker, in row-major (token, k) order: each token travels once per
  expert worker however many of its k experts live there (as DeepEP's dispatch does), and pair i reads row
  `token_index[i]` of `tokens`. Without `token_index`, `[control, rows [n, h], expert_ids]`: one row per pair
  (the elastic workers' form, and their resends).
- the dispatch's control: `StepControl`, `int64[1]` = `[active]` (whether the sender had work when
  micro-batch 0 started the step), or `ElasticControl`, `int64[5 + 2s]` = `[active, alive mask, layer, epoch,
  *slots, announced epoch, *announced slots]` (s slots per table).
- `Combine`, expert -> attention: `[control int64[1], outputs [n, h]]`, the outputs in the pairs' order, the
  control `CONTINUE` or `STOP` (every attention worker is out of work: finish this step and leave).

Tags: `message_tag(layer, micro_batch, m)` for the regular exchange, `RESEND_TAG` for the elastic resends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from mbridge_epoverlap.schedule.program import Phase, Stage

ACTIVE, IDLE = 1, 0  # a dispatch's control: the sending attention worker had work at the step's start, or not
CONTINUE, STOP = 1, 0  # a combine's control
RESEND_TAG = 1 << 24  # above every (layer, micro-batch) tag


def message_tag(layer: int, micro_batch: int, micro_batches: int) -> int:
    """The M2N tag of one (layer, micro-batch) transfer; unique within a decode step."""
    return layer * micro_batches + micro_batch


@dataclass(frozen=True)
class StepControl:
    """A plain dispatch's control: whether the sending attention worker had work when micro-batch 0 started the
    step (when none had, the expert workers answer that step's first combine with `STOP`)."""

    active: bool

    def encode(self) -> torch.Tensor:
        return torch.tensor([ACTIVE if self.active else IDLE], dtype=torch.int64)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> StepControl:
        if tensor.numel() != 1:
            raise ValueError(f"a step control is one int64, got {tensor.numel()}")
        return cls(int(tensor[0]) == ACTIVE)


@dataclass(frozen=True)
class ElasticControl:
    """An elastic dispatch's control.

    Attributes:
        active: as `StepControl.active`.
        mask: the expert workers alive (bit w: worker w), as the sender knows them.
        layer: the layer of the rows (a resend's receiver runs that layer's experts).
        epoch, slots: the layout epoch the step runs in and its table (slot -> expert).
        announced, announced_slots: the next epoch and its table (the current one while none is announced):
            the expert workers move weights for it during this step.
    """

    active: bool
    mask: int
    layer: int
    epoch: int
    slots: tuple[int, ...]
    announced: int
    announced_slots: tuple[int, ...]

    def encode(self) -> torch.Tensor:
        return torch.tensor([ACTIVE if self.active else IDLE, self.mask, self.layer, self.epoch, *self.slots,
                             self.announced, *self.announced_slots], dtype=torch.int64)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> ElasticControl:
        values = tensor.tolist()
        n, odd = divmod(len(values) - 5, 2)
        if n < 0 or odd:
            raise ValueError(f"an elastic control is 5 + 2 * slots int64s, got {len(values)}")
        return cls(values[0] == ACTIVE, values[1], values[2], values[3], tuple(values[4:4 + n]), values[4 + n],
                   tuple(values[5 + n:]))


Control = StepControl | ElasticControl


def decode_control(tensor: torch.Tensor) -> Control:
    """A dispatch's control tensor as its record (one int64: `StepControl`, more: `ElasticControl`)."""
    return StepControl.decode(tensor) if tensor.numel() == 1 else ElasticControl.decode(tensor)


@dataclass
class Dispatch:
    """Attention -> expert worker: the rows it needs and the expert of each (token, slot) pair.

    Attributes:
        control: `StepControl` or `ElasticControl`.
        tokens: hidden states [u, hidden]; one per pair when `token_index` is None.
        expert_ids: the expert of each pair, int64[n].
        token_index: the row of `tokens` each pair reads, int64[n] (None: row i is pair i's).
    """

    control: Control
    tokens: torch.Tensor
    expert_ids: torch.Tensor
    token_index: torch.Tensor | None = None

    @property
    def pairs(self) -> int:
        return int(self.expert_ids.shape[0])

    def encode(self) -> list[torch.Tensor]:
        if self.token_index is None:
            return [self.control.encode(), self.tokens, self.expert_ids]
        return [self.control.encode(), self.tokens, self.token_index, self.expert_ids]

    @classmethod
    def decode(cls, tensors: Sequence[torch.Tensor]) -> Dispatch:
        if len(tensors) == 4:
            control, tokens, index, ids = tensors
            return cls(decode_control(control), tokens, ids, index)
        if len(tensors) == 3:
            control, tokens, ids = tensors
            return cls(decode_control(control), tokens, ids)
        raise ValueError(f"a dispatch message has 3 or 4 tensors, got {len(tensors)}")


@dataclass
class Combine:
    """Expert -> attention worker: the expert outputs of the pairs it was sent, in their order; `stop` tells the
    attention workers that none of them had work (finish this step and leave)."""

    stop: bool
    outputs: torch.Tensor

    def encode(self) -> list[torch.Tensor]:
        return [torch.tensor([STOP if self.stop else CONTINUE], dtype=torch.int64), self.outputs]

    @classmethod
    def decode(cls, tensors: Sequence[torch.Tensor]) -> Combine:
        if len(tensors) != 2:
            raise ValueError(f"a combine message has 2 tensors, got {len(tensors)}")
        control, outputs = tensors
        return cls(int(control[0]) == STOP, outputs)


class Worker(Protocol):
    """What the worker process (`serving.engine.worker_main`) needs of any worker."""

    decode_steps: int

    def run(self) -> None:
        """Decode until there is no work left anywhere (the workers agree through their messages)."""

    def report(self, *, failed: bool = False) -> dict[str, Any]:
        """The rank's report fields: decode steps, stage times, and (attention) completions and step log."""

    def close(self) -> None:
        """Close the worker's communicators."""


class Transport:
    """The steps of the stage order an attention worker does not compute itself: moving its tokens to the
    experts and the outputs back (M2N to expert workers, an all-to-all among colocated ranks, or the elastic
    router). The handlers are named by the stage table's rule (`schedule.program.handler_name`) and take
    (micro-batch handle, layer).

    Attributes:
        stages: the (stage, phase) steps it handles.
        streams: whether decode steps may follow each other without draining the pipeline.
        events: what happened (reported as `events`), or None for a transport that records none.
    """

    stages: ClassVar[tuple[tuple[Stage, Phase], ...]] = ()
    streams: bool = True
    events: list[dict[str, Any]] | None = None

    def another_step(self) -> bool:
        """At a drained step boundary: whether any attention worker has work (False: leave)."""
        return True

    def nothing_to_decode(self) -> bool:
        """After `another_step` said go on: whether no attention worker has a sequence, so that every one may
        skip the step's layers together (an idle server then only waits for requests)."""
        return False

    def begin_step(self, step: int) -> None:
        """Before decode step `step`'s first step (streamed steps: before the round of its first layer, whose
        dispatches are the step's first; the combines of the step before may still be awaited)."""

    def end_step(self) -> None:
        """After the decode step's last step (streamed steps: at the next step's round boundary)."""

    def finish(self) -> None:
        """The worker is done (or failed)."""

    def close(self) -> None:
        """Close its communicators."""
