"""A planned deployment as the engine runs it: the `serve` layout flags of a `plan` result on this machine.

The planner sizes a deployment in nodes: `n_a` attention nodes and `n_e` expert nodes with `m` micro-batches in
the ping-pong (disaggregated), or `n_a` EP groups that each hold attention and `E / n_a` experts (colocated). The
engine runs one worker process per node. Where the machine has room for fewer processes than the plan has nodes,
the deployment is shrunk: the processes are split between attention and experts in the plan's proportion (at least
one of each), the expert workers are the largest count not above that share that divides the experts evenly (as
the plan's expert groups do), and `m` is kept: the ping-pong the plan chose is what is run.
"""

from __future__ import annotations

from dataclasses import dataclass

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.planning.search import Deployment


@dataclass(frozen=True)
class EngineLayout:
    """The engine's layout for a planned deployment.

    Attributes:
        attn_workers: attention worker processes (disaggregated; 0 when colocated).
        expert_workers: expert worker processes (disaggregated; 0 when colocated).
        micro_batches: the plan's m.
        colocated: colocated processes (0 when disaggregated).
        shrunk: the plan had more nodes than the machine has processes.
        why: one line: the plan's nodes and what they became.
    """

    attn_workers: int
    expert_workers: int
    micro_batches: int
    colocated: int
    shrunk: bool
    why: str

    def flags(self) -> list[str]:
        """The `serve` / `serve-bench` flags of this layout."""
        if self.colocated:
            return ["--colocated", str(self.colocated)]
        return ["--attn-workers", str(self.attn_workers), "--expert-workers", str(self.expert_workers),
                "--micro-batches", str(self.micro_batches)]

    def plan_kwargs(self) -> dict[str, int]:
        """The keyword arguments of `engine.run.make_plan` for this layout."""
        if self.colocated:
            return {"colocated": self.colocated, "micro_batches": 1}
        return {"attn_workers": self.attn_workers, "expert_workers": self.expert_workers,
                "micro_batches": self.micro_batches}


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def engine_layout(deployment: Deployment, *, workers: int, num_experts: int) -> EngineLayout:
    """`deployment` on a machine that runs up to `workers` worker processes, for a model of `num_experts` experts.

    Raises UsageError when `workers` cannot hold the deployment's kind (a disaggregated one needs two processes).
    """
    if workers < 1 or num_experts < 1:
        raise UsageError(f"--engine-workers {workers}: need at least 1 worker process (2 for a disaggregated plan)")
    if deployment.deployment == "colocated":
        groups = deployment.n_a
        processes = _largest_divisor_at_most(num_experts, min(groups, workers))
        shrunk = processes < groups
        why = (f"{groups} EP groups of {deployment.tp_a} GPUs" + (f", shrunk to {processes} processes (at most "
               f"{workers}, dividing the {num_experts} experts)" if shrunk else f" -> {processes} processes"))
        return EngineLayout(0, 0, 1, processes, shrunk, why)
    if workers < 2:
        raise UsageError(f"--engine-workers {workers}: a disaggregated plan needs at least 2 worker processes "
                         "(one attention, one expert worker)")
    nodes = deployment.n_a + deployment.n_e
    if nodes <= workers and num_experts % deployment.n_e == 0:
        attn, experts = deployment.n_a, deployment.n_e
    else:
        attn = min(max(round(workers * deployment.n_a / nodes), 1), workers - 1)
        experts = _largest_divisor_at_most(num_experts, workers - attn)
    shrunk = (attn, experts) != (deployment.n_a, deployment.n_e)
    why = (f"{deployment.n_a} attention + {deployment.n_e} expert nodes, m={deployment.m}"
           + (f"; shrunk to {attn} + {experts} processes (at most {workers}; attention's share "
              f"{deployment.n_a / nodes:.2f} kept as near as whole processes allow, expert workers dividing the "
              f"{num_experts} experts)" if shrunk else ""))
    return EngineLayout(attn, experts, deployment.m, 0, shrunk, why)
