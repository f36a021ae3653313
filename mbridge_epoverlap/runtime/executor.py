"""Runs a schedule (a list of `schedule.program.Step`) on a `MoEGPT`, stage by stage.

Each compute stage of each (micro-batch, layer) is its own autograd island: its inputs are detached
leaves that require grad, so its backward can run on its own, at the step the schedule says, and hand
the input gradients on to the island (or the all-to-all) that produced them. Communication steps are an
issue (start the all-to-all asynchronously) and a wait; forward all-to-alls move tokens, backward ones
move gradients the inverse way.

Backward compute is split the way the schedule splits it: `*_dgrad` runs autograd through the island
while a `WeightGradStore` captures the weight-gradient closures of the deferrable GEMMs (attention
projections, experts, shared expert); `*_wgrad` runs them. Small weights (norms, router, embedding,
output head) get their gradients during dgrad or `post_bwd`.

The executor runs steps in exactly the given order and never reorders them: the simulator executes the
same lists with costs. Its step handlers are looked up from the stage table (`program.STAGES`, one
handler per stage and phase), and it checks every step's dependencies with the table's rules before
running it. A forward-only (decode/evaluation) schedule runs without autograd and frees each layer's
state after the last step that uses it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mbridge_epoverlap.moe.dispatcher import DispatchHandle
from mbridge_epoverlap.moe.model import MoEGPT
from mbridge_epoverlap.moe.wgrad import DOWN_PROJECTION, WeightGradStore, default_store, use_weight_grad_store
from mbridge_epoverlap.runtime.ranges import Ranges
from mbridge_epoverlap.schedule.program import (
    ATTN,
    COMBINE,
    COMBINE_BWD,
    DISPATCH,
    DISPATCH_BWD,
    EXPERTS,
    EXPERTS_DGRAD,
    POST,
    POST_BWD,
    STAGES,
    Kind,
    Phase,
    Stage,
    Step,
    bind_handlers,
    check_schedule,
    is_forward_only,
    predecessors,
)

Tensors = dict[str, torch.Tensor]
StageKey = tuple[int, int, str]  # (micro-batch, layer, stage)
MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels), each [micro_batch_size, seq]


@dataclass
class Island:
    """One stage's autograd graph: detached input leaves, outputs, and gradients arriving for the outputs."""

    leaves: Tensors
    outputs: Tensors
    grads: Tensors = field(default_factory=dict)

    def add_grad(self, name: str, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        self.grads[name] = self.grads[name] + grad if name in self.grads else grad

    def backward(self) -> Tensors:
        """Backpropagate the collected output gradients; return the gradients of the input leaves."""
        # Sorted roots: the same graph gets its roots in the same order whatever the schedule.
        names = sorted(n for n in self.grads if self.outputs[n].requires_grad)
        if names:
            torch.autograd.backward([self.outputs[n] for n in names], [self.grads[n] for n in names])
        return {name: leaf.grad for name, leaf in self.leaves.items() if leaf.grad is not None}


class _Ready:
    """A finished 'communication' (dense layers move nothing)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor


@dataclass
class _LayerState:
    """Everything in flight for one (micro-batch, layer)."""

    handle: DispatchHandle | None = None
    attn: Island | None = None
    experts: Island | None = None
    post: Island | None = None
    pending: dict[str, Any] = field(default_factory=dict)
    received: torch.Tensor | None = None
    combined: torch.Tensor | None = None
    grad_combined: torch.Tensor | None = None
    grad_received: torch.Tensor | None = None


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def last_uses(steps: Sequence[Step]) -> dict[int, list[tuple[int, int]]]:
    """Step index -> the (micro-batch, layer) states no later step runs in or depends on."""
    num_layers: dict[int, int] = {}
    for step in steps:
        num_layers[step.micro_batch] = max(num_layers.get(step.micro_batch, 0), step.layer + 1)
    last: dict[tuple[int, int], int] = {}
    for index, step in enumerate(steps):
        last[(step.micro_batch, step.layer)] = index
        for mb, layer, _ in predecessors(step, num_layers[step.micro_batch]):
            last[(mb, layer)] = index
    ends: dict[int, list[tuple[int, int]]] = {}
    for key, index in last.items():
        ends.setdefault(index, []).append(key)
    return ends


class ScheduleExecutor:
    """Executes schedules on one rank.

    Args:
        model: the rank's model (its layers provide the stages).
        store: where deferred weight gradients queue (the default store if None); the model's deferrable
            layers are pointed at it, so the `*_wgrad` steps run what the `*_dgrad` steps queued.
        ranges: profiler/NVTX ranges around every step (none if None).
        on_step: called with (index, step) before each step (heartbeats, fault injection).
        trace: record every executed step with the stage results it read (`self.trace`), to compare the
            executed order and data flow with the stage table and the simulator.
    """

    def __init__(self, model: MoEGPT, *, store: WeightGradStore | None = None, ranges: Ranges | None = None,
                 on_step: Callable[[int, Step], None] | None = None, trace: bool = False) -> None:
        self.model = model
        self.store = store or default_store()
        use_weight_grad_store(model, self.store)
        self.ranges = ranges
        self.on_step = on_step
        self._states: dict[tuple[int, int], _LayerState] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._batches: Sequence[MicroBatch] = ()
        self._loss_scale = 1.0
        self._validated: Sequence[Step] | None = None
        self.comm_step_s = 0.0  # training-thread time in communication steps (issue + wait) of the last run
        # Durations of the last run, per range name (`attn`, `dispatch.issue`, `dispatch.wait`, ...), one entry
        # per step; per COMM stage name the collective's own time on the communication thread (CPU only), and
        # per wait `<stage>.blocked` (1.0 if it blocked, else 0.0) and `<stage>.resume` (how long a blocked wait
        # took to return after the collective ended, else 0): the stage costs the simulator takes.
        self.step_s: dict[str, list[float]] = {}
        self.run_s = 0.0  # wall time of the last run
        self.trace: list[tuple[Step, frozenset[StageKey]]] | None = [] if trace else None
        self._reads: set[StageKey] = set()
        self._ends: dict[int, list[tuple[int, int]]] = {}
        self._forward_only = False
        # One handler per stage and phase of the stage table; a stage without one fails here, not mid-run.
        self._handlers: dict[tuple[str, Phase], Callable[[int, int], None]] = bind_handlers(
            self, ((stage, phase) for stage in STAGES.values() for phase in stage.phases))

    def run(self, steps: Sequence[Step], batches: Sequence[MicroBatch], *,
            loss_scale: float = 1.0) -> list[torch.Tensor]:
        """Run forward and backward of every micro-batch as `steps` order them.

        Args:
            steps: a complete schedule over `len(batches)` micro-batches and the model's layers.
            batches: (tokens, labels) per micro-batch.
            loss_scale: each micro-batch's loss is multiplied by this before backward (1/num_micro_batches
                for a mean over micro-batches).

        Returns:
            Each micro-batch's loss (fp32 scalar, detached, unscaled), in micro-batch order.
        """
        if steps is not self._validated:
            check_schedule(list(steps))
            self._validated = steps
            self._forward_only = is_forward_only(list(steps))
            self._ends = last_uses(steps) if self._forward_only else {}
        self._batches, self._loss_scale = batches, loss_scale
        self._states.clear()
        self._losses.clear()
        self.comm_step_s = 0.0
        self.step_s = {}
        if self.trace is not None:
            self.trace.clear()
        run_start = time.perf_counter()
        try:
            # Forward-only: no backward will come, so build no autograd graph.
            with torch.no_grad() if self._forward_only else contextlib.nullcontext():
                for index, step in enumerate(steps):
                    self._step(index, step)
            self.run_s = time.perf_counter() - run_start
            if self._states or self.store.pending():
                raise RuntimeError(f"schedule left work behind: layers {sorted(self._states)}, "
                                   f"weight gradients {self.store.pending()}")
            return [self._losses[mb] for mb in range(len(batches))]
        finally:
            self._states.clear()
            self.store.clear()

    def comm_account(self) -> tuple[float, float]:
        """(exposed, collective) seconds of the last run: the training thread's time in issue and wait steps less
        the time blocked waits took to resume after their collective ended, and the collectives' own time on the
        communication thread (0 without one). 1 - exposed / collective is the share of communication hidden."""
        resumed = sum(sum(times) for name, times in self.step_s.items() if name.endswith(".resume"))
        collective = sum(sum(self.step_s.get(stage.name, ())) for stage in STAGES.values() if stage.kind is Kind.COMM)
        return self.comm_step_s - resumed, collective

    def _step(self, index: int, step: Step) -> None:
        if self.on_step is not None:
            self.on_step(index, step)
        handler = self._handlers[(step.stage, step.phase)]
        name = step.stage if step.phase is Phase.RUN else f"{step.stage}.{step.phase.value}"
        pending = None
        if step.phase is Phase.WAIT and (step.micro_batch, step.layer) in self._states:
            pending = self._states[(step.micro_batch, step.layer)].pending.get(step.stage)
        self._reads = set()
        start = time.perf_counter()
        if self.ranges is None:
            handler(step.micro_batch, step.layer)
        else:
            with self.ranges(name):
                handler(step.micro_batch, step.layer)
        elapsed = time.perf_counter() - start
        self.step_s.setdefault(name, []).append(elapsed)
        if step.phase is not Phase.RUN:
            self.comm_step_s += elapsed
        span = pending.span() if hasattr(pending, "span") else None
        if span is not None:
            self.step_s.setdefault(step.stage, []).append(span[1] - span[0])
            # Whether the wait blocked, and how long the thread then took to resume once it ended.
            blocked = span[1] > start
            self.step_s.setdefault(f"{step.stage}.blocked", []).append(float(blocked))
            self.step_s.setdefault(f"{step.stage}.resume", []).append(
                max(0.0, start + elapsed - span[1]) if blocked else 0.0)
        if self.trace is not None:
            self.trace.append((step, frozenset(self._reads)))
        for key in self._ends.get(index, ()):
            state = self._states.pop(key, None)
            if state is not None and state.pending:
                raise RuntimeError(f"micro-batch {key[0]} layer {key[1]}: {sorted(state.pending)} issued but "
                                   "never waited")

    # --- helpers ---------------------------------------------------------------------------------
    def _state(self, mb: int, layer: int) -> _LayerState:
        return self._states.setdefault((mb, layer), _LayerState())

    def _last(self, layer: int) -> bool:
        return layer == len(self.model.layers) - 1

    def _dispatcher(self, layer: int) -> Any:
        return self.model.layers[layer].dispatcher

    def _need(self, value: Any, stage: Stage, mb: int, layer: int) -> Any:
        """`value`, the result of `stage` of (mb, layer), recorded as read by the running step."""
        if value is None:
            raise RuntimeError(f"micro-batch {mb} layer {layer}: the {stage.name} result is not available "
                               "at this step")
        self._reads.add((mb, layer, stage.name))
        return value

    # --- forward ---------------------------------------------------------------------------------
    def _attn(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        leaves: Tensors = {}
        if layer == 0:
            x = self.model.embed(self._batches[mb][0])
        else:
            prev = self._need(self._state(mb, layer - 1).post, POST, mb, layer - 1)
            x = leaves["x"] = _leaf(prev.outputs["z"])
        outputs, st.handle = self.model.layers[layer].attn_stage(x)
        st.attn = Island(leaves, outputs)

    def _dispatch_issue(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        tokens = self._need(st.attn, ATTN, mb, layer).outputs["tokens"].detach()
        d = self._dispatcher(layer)
        st.pending[DISPATCH.name] = _Ready(tokens) if d is None else d.dispatch_async(st.handle, tokens)

    def _dispatch_wait(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        st.received = st.pending.pop(DISPATCH.name).wait()

    def _experts(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        attn = self._need(st.attn, ATTN, mb, layer)
        leaves = {"received": _leaf(self._need(st.received, DISPATCH, mb, layer))}
        if "y" in attn.outputs:
            leaves["y"] = _leaf(attn.outputs["y"])
        outputs = self.model.layers[layer].experts_stage(leaves["received"], st.handle, leaves.get("y"))
        st.experts, st.received = Island(leaves, outputs), None

    def _combine_issue(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        out = self._need(st.experts, EXPERTS, mb, layer).outputs["expert_out"].detach()
        d = self._dispatcher(layer)
        st.pending[COMBINE.name] = _Ready(out) if d is None else d.combine_async(st.handle, out)

    def _combine_wait(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        st.combined = st.pending.pop(COMBINE.name).wait()

    def _post(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        attn = self._need(st.attn, ATTN, mb, layer)
        experts = self._need(st.experts, EXPERTS, mb, layer)
        leaves = {"combined": _leaf(self._need(st.combined, COMBINE, mb, layer)),
                  "resid": _leaf(attn.outputs["resid"])}
        if "probs" in attn.outputs:
            leaves["probs"] = _leaf(attn.outputs["probs"])
        if "shared_out" in experts.outputs:
            leaves["shared_out"] = _leaf(experts.outputs["shared_out"])
        z = self.model.layers[layer].post_stage(leaves["combined"], leaves["resid"], st.handle, leaves.get("probs"),
                                                leaves.get("shared_out"))
        st.combined = None
        if self._last(layer):
            loss = self.model.loss(z, self._batches[mb][1])
            self._losses[mb] = loss.detach().float()
            st.post = Island(leaves, {"loss": loss * self._loss_scale})
        else:
            st.post = Island(leaves, {"z": z})

    # --- backward --------------------------------------------------------------------------------
    def _post_bwd(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        post = self._need(st.post, POST, mb, layer)
        if self._last(layer):
            post.add_grad("loss", torch.ones_like(post.outputs["loss"]))
        grads = post.backward()
        attn, experts = self._need(st.attn, ATTN, mb, layer), self._need(st.experts, EXPERTS, mb, layer)
        st.grad_combined = grads.get("combined")
        attn.add_grad("resid", grads.get("resid"))
        attn.add_grad("probs", grads.get("probs"))
        experts.add_grad("shared_out", grads.get("shared_out"))
        st.post = None

    def _combine_bwd_issue(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        grad = self._need(st.grad_combined, POST_BWD, mb, layer)
        d = self._dispatcher(layer)
        st.pending[COMBINE_BWD.name] = _Ready(grad) if d is None else d.combine_grad_async(st.handle, grad)
        st.grad_combined = None

    def _combine_bwd_wait(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        self._need(st.experts, EXPERTS, mb, layer).add_grad("expert_out", st.pending.pop(COMBINE_BWD.name).wait())

    def _experts_dgrad(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        experts = self._need(st.experts, EXPERTS, mb, layer)
        with self.store.capture((mb, layer, "experts")):
            grads = experts.backward()
        st.grad_received = grads.get("received")
        self._need(st.attn, ATTN, mb, layer).add_grad("y", grads.get("y"))
        st.experts = None

    def _experts_wgrad(self, mb: int, layer: int) -> None:
        self.store.flush((mb, layer, "experts"))

    def _experts_wgrad_down(self, mb: int, layer: int) -> None:
        self.store.flush(((mb, layer, "experts"), DOWN_PROJECTION))

    def _dispatch_bwd_issue(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        grad = self._need(st.grad_received, EXPERTS_DGRAD, mb, layer)
        d = self._dispatcher(layer)
        st.pending[DISPATCH_BWD.name] = _Ready(grad) if d is None else d.dispatch_grad_async(st.handle, grad)
        st.grad_received = None

    def _dispatch_bwd_wait(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        self._need(st.attn, ATTN, mb, layer).add_grad("tokens", st.pending.pop(DISPATCH_BWD.name).wait())

    def _attn_dgrad(self, mb: int, layer: int) -> None:
        st = self._state(mb, layer)
        attn = self._need(st.attn, ATTN, mb, layer)
        with self.store.capture((mb, layer, "attn")):
            grads = attn.backward()
        if layer > 0:
            below = self._need(self._state(mb, layer - 1).post, POST, mb, layer - 1)
            below.add_grad("z", grads.get("x"))
        st.attn = None

    def _attn_wgrad(self, mb: int, layer: int) -> None:
        self.store.flush((mb, layer, "attn"))
        st = self._states.get((mb, layer))
        if st is not None and st.attn is None and st.experts is None and st.post is None and not st.pending:
            del self._states[(mb, layer)]
