"""What every serving worker process is told: the model, the layout, its requests (a JSON file).

Ranks 0..A-1 are attention workers and A..A+E-1 expert workers (disaggregated), or ranks 0..N-1 are
colocated workers; `role_of` is the one place that says so. Requests are dealt to the attention workers
round robin (`deal_requests`, the one place that does it; `EnginePlan.arrival_order` undoes it), and the
mode is derived from the process count, not stored beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.program import Role

if TYPE_CHECKING:
    from mbridge_epoverlap.serving.model.spec import ModelSpec
    from mbridge_epoverlap.serving.workers.requests import Request

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"


@dataclass(frozen=True)
class EnginePlan:
    """The engine's layout and workload.

    Attributes:
        source: checkpoint directory or recipe name (`serving.model.checkpoint.load_spec`).
        attn_workers, expert_workers: disaggregated worker counts (A, E).
        processes: colocated process count (N); 0 for a disaggregated plan (`mode` is derived from it).
        micro_batches: m, micro-batches in flight per attention worker.
        order: colocated order, "two_batch_overlap" or "sequential" (disaggregated always ping-pong).
        placement: expert id -> expert worker (or colocated rank).
        max_new_tokens: generation limit per request.
        max_batch: sequences decoding at once per attention worker (continuous batching).
        requests: per attention worker, its requests as {"id", "prompt_ids"} (`deal_requests`).
        backend: M2N backend name (`comm.m2n.make_communicator`).
        slot_bytes: M2N buffer size, enough for the largest message.
        timeout_s: limit of every wait between workers.
        num_layers, seed, dtype: recipe-model settings `load_spec` passes on.
        elastic: keep decoding through the loss of expert workers (`serving.elastic`).
        slots: elastic mode's physical slots, the expert in each (`eplb` phy2log, worker by worker).
        expert_restore: elastic mode may restore experts whose every replica died from the checkpoint.
        kill: fault injection, `(expert worker index, decode step)` pairs: that worker SIGKILLs itself then.
        rebalance_every: elastic mode re-solves the placement for the measured load every this many decode
            steps, moving weights between expert workers (0: never).
        rejoin_after_steps: elastic mode starts a replacement for a lost expert worker and admits it this many
            decode steps after the loss (0: never).
        rejoin_hold: elastic mode holds decoding at a replacement's admission step until it is ready (else it
            joins at the first step boundary where it is, while decoding goes on).
        rebalance_threshold: a periodic rebalance is skipped (no solve, nothing moved) while max/mean expert
            load over the live expert workers is at most this (0: 1.1, or the window's routing noise when higher,
            `elastic.workers.routing_noise`).
        weight_slot_bytes: M2N slot size of the channels between expert workers that carry moved weights.
        online_requests: online serving (`serving.workers.online`): per attention worker, the front end's
            endpoint its requests come from; empty: the batch run of `requests`.
        online_events: online serving: the front end's endpoint every attention worker sends its tokens to.
        max_model_len: online serving: the longest sequence (prompt and generated tokens) a request may reach.
        replicated_experts: colocated processes each hold every expert and keep their tokens: no all-to-all,
            N data-parallel engines behind one front end (N times the expert memory; each process reads every
            expert's weights each step).
        prefill_budget: online serving: the prompt tokens one admission (a micro-batch's step boundary; a
            colocated rank's step) may feed, a longer prompt in chunks over several steps
            (`RequestQueue.prefill_budget`); 0 means `max_model_len`.
        prefix_cache_bytes: online serving: each attention worker's automatic prefix cache, in bytes
            (`model.prefix_cache`); 0: off.
        emulate_hosts: emulated hosts (`engine.hosts`): attention workers on host 0, expert workers on host 1,
            each host a network namespace joined by a link shaped to `emulate_link_gbps` (0: one real host).
        emulate_link_gbps: the emulated link's rate in Gbit/s.
        threads: torch intra-op threads of every worker process (`default_threads`: the cores over the
            processes); 0 in a plan written before the field existed means one.
        store_hosted: the rendezvous store is held by the process that starts the workers (the online front
            end), not by rank 0, so that any attention worker may be lost (`EnginePlan.hostable_store`).
    """

    source: str
    attn_workers: int = 1
    expert_workers: int = 1
    processes: int = 0
    micro_batches: int = 2
    order: str = "ping_pong"
    placement: tuple[int, ...] = ()
    max_new_tokens: int = 16
    max_batch: int = 64
    requests: tuple[tuple[dict[str, Any], ...], ...] = field(default=())
    backend: str = "m2n"
    slot_bytes: int = 1 << 20
    timeout_s: float = 30.0
    num_layers: int | None = None
    seed: int = 0
    dtype: str = "float32"
    elastic: bool = False
    slots: tuple[int, ...] = ()
    expert_restore: bool = True
    kill: tuple[tuple[int, int], ...] = ()
    rebalance_every: int = 0
    rejoin_after_steps: int = 0
    rebalance_threshold: float = 0.0
    rejoin_hold: bool = False
    weight_slot_bytes: int = 0
    online_requests: tuple[str, ...] = ()
    online_events: str = ""
    max_model_len: int = 0
    prefill_budget: int = 0
    prefix_cache_bytes: int = 0
    replicated_experts: bool = False
    emulate_hosts: int = 0
    emulate_link_gbps: float = 0.0
    threads: int = 0
    store_hosted: bool = False

    @property
    def online(self) -> bool:
        """Whether requests arrive while the workers run (a server), rather than all dealt up front."""
        return bool(self.online_requests)

    @property
    def mode(self) -> str:
        """"colocated" (N processes with both roles) or "disaggregated" (attention and expert workers)."""
        return COLOCATED if self.processes else DISAGGREGATED

    def load_spec(self) -> ModelSpec:
        """The model this plan serves (`serving.model.checkpoint.load_spec` with the plan's model settings)."""
        from mbridge_epoverlap.serving.model.checkpoint import load_spec

        return load_spec(self.source, seed=self.seed, num_layers=self.num_layers, dtype=self.dtype)

    def arrival_order(self) -> list[str]:
        """Request ids in the order they were given (undoing `deal_requests`' round robin)."""
        ids: list[str] = []
        for position in range(max((len(d) for d in self.requests), default=0)):
            ids += [str(dealt[position]["id"]) for dealt in self.requests if position < len(dealt)]
        return ids

    def arrival_requests(self) -> list[Request]:
        """The plan's requests in the order they were given."""
        from mbridge_epoverlap.serving.workers.requests import Request

        by_id = {str(r["id"]): r for dealt in self.requests for r in dealt}
        return [Request(i, tuple(by_id[i]["prompt_ids"])) for i in self.arrival_order()]

    @property
    def layout_epochs(self) -> bool:
        """Whether the elastic layout can change at step boundaries (rebalancing or rejoining)."""
        return self.elastic and bool(self.rebalance_every or self.rejoin_after_steps)

    @property
    def hostable_store(self) -> bool:
        """Whether the starter of the workers should hold the rendezvous (`store_hosted`): online elastic
        serving with several attention workers, where each may be lost (with layout epochs too: their step
        agreement goes on without a lost one, `elastic.sync`)."""
        return self.online and self.elastic and self.attn_workers > 1

    @property
    def expendable_ranks(self) -> list[int]:
        """Ranks whose loss the run survives: elastic mode's expert workers, and online the attention workers
        (after the first, which then holds the rendezvous store, unless `store_hosted`)."""
        if not self.elastic:
            return []
        if not self.online:
            return self.expert_ranks
        return self.expert_ranks + (self.attention_ranks if self.store_hosted else self.attention_ranks[1:])

    @property
    def threads_per_process(self) -> int:
        """The torch threads each worker process runs with (at least one)."""
        return max(1, self.threads)

    @property
    def world(self) -> int:
        return self.processes if self.mode == COLOCATED else self.attn_workers + self.expert_workers

    @property
    def attention_ranks(self) -> list[int]:
        return list(range(self.processes if self.mode == COLOCATED else self.attn_workers))

    @property
    def expert_ranks(self) -> list[int]:
        if self.mode == COLOCATED:
            return list(range(self.processes))
        return list(range(self.attn_workers, self.attn_workers + self.expert_workers))

    def role_of(self, rank: int) -> tuple[Role | None, int]:
        """(role, index within the role) of `rank`; role None means colocated (both roles)."""
        if self.mode == COLOCATED:
            return None, rank
        if rank < self.attn_workers:
            return Role.ATTENTION, rank
        return Role.EXPERT, rank - self.attn_workers

    def role_name(self, rank: int) -> str:
        """"attention worker 0", "expert worker 1", "colocated worker 2"."""
        role, index = self.role_of(rank)
        kind = "colocated worker" if role is None else f"{role.value} worker"
        return f"{kind} {index}"

    def rank_names(self) -> dict[int, str]:
        """How failure messages name each rank: role, index and rank."""
        return {rank: f"{self.role_name(rank)} (rank {rank})" for rank in range(self.world)}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EnginePlan:
        raw = json.loads(text)
        raw.pop("mode", None)  # written by older versions; derived from `processes` now
        raw["placement"] = tuple(raw["placement"])
        raw["requests"] = tuple(tuple(r) for r in raw["requests"])
        raw["slots"] = tuple(raw.get("slots", ()))
        raw["kill"] = tuple(tuple(k) for k in raw.get("kill", ()))
        raw["online_requests"] = tuple(raw.get("online_requests", ()))
        return cls(**raw)


def model_source(checkpoint: str | os.PathLike[str] | None, recipe: str | None, default: str | None = None) -> str:
    """What `EnginePlan.source` holds for a model named by a checkpoint directory or a recipe name (the
    checkpoint first); neither: `default`, else the recipes' default. The commands and the server both read
    their flags through this."""
    if checkpoint is not None:
        return str(checkpoint)
    if recipe:
        return recipe
    if default is not None:
        return default
    from mbridge_epoverlap.recipes import DEFAULT_RECIPE

    return DEFAULT_RECIPE


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; the CPU count where affinity is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_threads(processes: int, cores: int | None = None) -> int:
    """Torch threads per worker process when the layout does not say: the cores shared evenly by the
    processes, at least one each (one process on two cores gets both; two get one each, as before)."""
    return max(1, (available_cores() if cores is None else cores) // max(1, processes))


def deal_requests(requests: Sequence[Request], readers: int) -> tuple[tuple[dict[str, Any], ...], ...]:
    """`requests` dealt round robin to `readers` attention workers, each as {"id", "prompt_ids"}."""
    dealt: list[list[dict[str, Any]]] = [[] for _ in range(readers)]
    for i, request in enumerate(requests):
        dealt[i % readers].append({"id": request.id, "prompt_ids": list(request.prompt_ids)})
    return tuple(tuple(d) for d in dealt)


def check_layout(*, attn_workers: int, expert_workers: int, micro_batches: int, processes: int, colocated: bool,
                 num_experts: int) -> None:
    """Raise UsageError for a layout no worker could run (before any starts)."""
    if colocated:
        if processes < 1:
            raise UsageError(f"--colocated {processes}: need at least one process")
        if processes > num_experts:
            raise UsageError(f"--colocated {processes} is more processes than the model's {num_experts} experts; "
                             f"use at most {num_experts}")
    else:
        if attn_workers < 1:
            raise UsageError(f"--attn-workers {attn_workers}: need at least one attention worker")
        if expert_workers < 1:
            raise UsageError(f"--expert-workers {expert_workers}: need at least one expert worker")
        if expert_workers > num_experts:
            raise UsageError(f"--expert-workers {expert_workers} is more than the model's {num_experts} experts; "
                             f"use at most {num_experts}")
    if micro_batches < 1:
        raise UsageError(f"--micro-batches {micro_batches}: need at least 1")
