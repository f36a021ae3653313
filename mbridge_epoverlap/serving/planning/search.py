"""Deployment planner for disaggregated expert parallelism (MegaScale-Infer's Algorithm 1).

Search space: attention TP size `tp_a`, expert TP size `tp_e`, experts per expert node, attention
replicas `n_a`, micro-batches `m` in 1..4, and the global batch `B`. For every combination of the
first five the largest batch that meets the time-between-tokens SLO and fits the KV cache is found
by binary search (over the per-node micro-batch `b_a`; `B = m * n_a * b_a`), and the plan with the
highest throughput per cost wins. The paper derives `n_a` from the balance `T_a ~ T_e`; here every
candidate `n_a` is evaluated instead (vectorised, so it costs milliseconds), which finds the balance
point and also lets callers sweep `n_a` on purpose.

A colocated EP plan (attention and experts on the same GPUs, no overlap) is the baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.planning import perf_model as pm
from mbridge_epoverlap.serving.planning.catalog import GPU, GPUS, Model, get_gpu, get_model

if TYPE_CHECKING:
    from mbridge_epoverlap.schedule.timeline import Timeline

TP_CHOICES: tuple[int, ...] = (1, 2, 4, 8)
MICRO_BATCH_CHOICES: tuple[int, ...] = (1, 2, 3, 4)
# Attention replicas tried: every count up to 16, then coarser steps (callers may fix any count).
REPLICA_CHOICES: tuple[int, ...] = tuple(range(1, 17)) + (20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)
MAX_BATCH_PER_NODE = 8192  # sequences per micro-batch per attention node; a sanity cap, reported when it binds
DEFAULT_CONTEXT = 730  # MegaScale-Infer's workload: median input 571 + output 159 tokens
DEFAULT_SLO_MS = 150.0


@dataclass(frozen=True)
class Deployment:
    """One deployment and what the performance model predicts for it.

    `t_attn_ms`, `t_expert_ms` and `t_comm_ms` are per micro-batch per MoE layer; `t_other_ms` is
    what the attention nodes do outside the MoE pipeline in one decode step (dense leading layers, LM
    head, for all micro-batches); `tbt_ms`, the time between tokens, is the ping-pong makespan over
    the MoE layers plus `t_other_ms`. `B` is the global batch (sequences decoding at once);
    throughput is `B / tbt`.
    """

    model: str
    deployment: str  # "disaggregated" or "colocated"
    attn_gpu: str
    expert_gpu: str
    tp_a: int
    tp_e: int
    n_a: int
    n_e: int
    experts_per_group: int
    m: int
    B: int
    b_a: int
    tokens_per_expert: float
    t_attn_ms: float
    t_expert_ms: float
    t_comm_ms: float
    t_other_ms: float
    tbt_ms: float
    tbt_slo_ms: float
    context: int
    gpus: int
    throughput_tokens_s: float
    throughput_per_gpu: float
    cost_per_hour: float
    throughput_per_cost: float
    binding_constraint: str
    attn_memory_gb: float
    expert_memory_gb: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"{self.model} {self.deployment} {self.attn_gpu}+{self.expert_gpu}: tp_a={self.tp_a} tp_e={self.tp_e} "
            f"n_a={self.n_a} n_e={self.n_e} m={self.m} B={self.B}; TBT {self.tbt_ms:.1f} ms; "
            f"{self.throughput_tokens_s:,.0f} tok/s; {self.throughput_per_cost:,.0f} tok/s per price unit "
            f"({self.binding_constraint} binds)"
        )


def _positive_number(flag: str, value: Any, example: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{flag} must be a number, got {value!r}; pass e.g. {flag} {example}") from None
    if not math.isfinite(number) or number <= 0:
        raise UsageError(f"{flag} must be > 0, got {value!r}; pass e.g. {flag} {example}")
    return number


def _choices(flag: str, fixed: int | None, allowed: Sequence[int]) -> tuple[int, ...]:
    if fixed is None:
        return tuple(allowed)
    if isinstance(fixed, bool) or not isinstance(fixed, (int, np.integer)) or fixed not in allowed:
        shown = ", ".join(map(str, allowed)) if len(allowed) <= 12 else f"{allowed[0]}..{allowed[-1]}"
        raise UsageError(f"{flag} must be one of {shown}, got {fixed!r}")
    return (int(fixed),)


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _gb(x: float) -> float:
    return round(float(x) / 1e9, 2)


@dataclass(frozen=True)
class _Inputs:
    model: Model
    attn: GPU
    expert: GPU
    slo_s: float
    context: int
    params: pm.PerfParams


def _resolve(
    model: str | Model,
    attn_gpu: str | GPU,
    expert_gpu: str | GPU | None,
    tbt_slo_ms: float,
    context: int,
    prices: dict[str, float] | None,
    params: pm.PerfParams | None,
) -> _Inputs:
    model_obj = model if isinstance(model, Model) else get_model(model)
    attn = attn_gpu if isinstance(attn_gpu, GPU) else get_gpu(attn_gpu, flag="--attn-gpu", prices=prices)
    if expert_gpu is None:
        expert = attn
    else:
        expert = expert_gpu if isinstance(expert_gpu, GPU) else get_gpu(expert_gpu, flag="--expert-gpu", prices=prices)
    slo = _positive_number("--tbt-slo-ms", tbt_slo_ms, "150")
    ctx = _positive_number("--context", context, "730")
    if ctx != int(ctx):
        raise UsageError(f"--context must be a whole number of tokens, got {context!r}")
    return _Inputs(model_obj, attn, expert, slo / 1e3, int(ctx), params or pm.PerfParams())


def _grid(**axes: Sequence[int]) -> dict[str, np.ndarray]:
    """Cartesian product of the axes as flat arrays."""
    names = list(axes)
    mesh = np.meshgrid(*[np.asarray(axes[n], dtype=np.float64) for n in names], indexing="ij")
    return {name: values.ravel() for name, values in zip(names, mesh, strict=True)}


def _binary_search(tbt: Callable[[np.ndarray, np.ndarray], np.ndarray], upper: np.ndarray, slo_s: float) -> np.ndarray:
    """Largest integer b in [0, upper] with tbt(b) <= slo (0 if even b = 1 misses), per element.

    Time between tokens grows with the batch, so the feasible batches of each configuration form a
    prefix and bisection finds its end in log2(upper) vectorised steps. `tbt(b, rows)` evaluates
    the configurations `rows` only; configurations whose search has ended drop out, and the first
    probe is the memory limit itself, which settles every configuration that memory (not the SLO)
    limits in one step.
    """
    lo = np.zeros_like(upper)
    hi = upper.copy()
    rows = np.flatnonzero(hi >= 1)
    if rows.size:
        ok = tbt(hi[rows], rows) <= slo_s
        lo[rows[ok]] = hi[rows[ok]]
        hi[rows[~ok]] -= 1
    rows = np.flatnonzero(lo < hi)
    while rows.size:
        mid = np.ceil((lo[rows] + hi[rows]) / 2)
        ok = tbt(mid, rows) <= slo_s
        lo[rows] = np.where(ok, mid, lo[rows])
        hi[rows] = np.where(ok, hi[rows], mid - 1)
        rows = rows[lo[rows] < hi[rows]]
    return lo


def _subset(g: dict[str, np.ndarray], rows: np.ndarray | None) -> dict[str, np.ndarray]:
    return g if rows is None else {k: v[rows] for k, v in g.items()}


def _disaggregated_times(
    x: _Inputs, g: dict[str, np.ndarray], b: np.ndarray, rows: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Stage times and time between tokens of configurations `g` (or its `rows`) at batch `b`."""
    m, p = x.model, x.params
    g = _subset(g, rows)
    tokens_per_expert = b * g["n_a"] * m.top_k / m.experts
    tokens_per_group = tokens_per_expert * g["epg"]
    t_attn = pm.attention_time(m, x.attn, g["tp_a"], b, x.context, p)
    t_expert = pm.expert_time(m, x.expert, g["tp_e"], tokens_per_expert, g["epg"], p)
    t_comm = pm.m2n_time(m, x.attn, x.expert, g["tp_a"], g["tp_e"], b, tokens_per_group, p)
    t_dense = pm.dense_layer_time(m, x.attn, g["tp_a"], b, x.context, p) if m.dense_layers else 0.0
    t_head = pm.head_time(m, x.attn, g["tp_a"], b, p)
    tbt = pm.decode_step_time(m, t_attn, t_expert, t_comm, g["m"], t_dense, t_head)
    t_other = g["m"] * (m.dense_layers * t_dense + t_head)
    return {
        "t_attn": t_attn,
        "t_expert": t_expert,
        "t_comm": t_comm,
        "t_other": t_other,
        "tbt": tbt,
        "tokens_per_expert": tokens_per_expert,
    }


def _expert_layouts(x: _Inputs, tp_e_set: Sequence[int], epg_set: Sequence[int]) -> list[tuple[int, int]]:
    """(tp_e, experts per node) pairs whose expert weights fit; raise if none does."""
    mod, p = x.model, x.params
    fit = [
        (t, e)
        for t in tp_e_set
        for e in epg_set
        if pm.expert_weight_bytes(mod, e, p) <= pm.usable_memory(x.expert, t, p)
    ]
    if not fit:
        need = _gb(pm.expert_weight_bytes(mod, min(epg_set), p))
        have = _gb(pm.usable_memory(x.expert, max(tp_e_set), p))
        raise UsageError(
            f"expert memory binds: {min(epg_set)} expert(s) of {mod.name} need {need} GB but {max(tp_e_set)} x "
            f"{x.expert.name} hold {have} GB usable; choose an --expert-gpu with more memory"
        )
    return fit


def _attention_layouts(x: _Inputs, tp_a_set: Sequence[int]) -> list[int]:
    """tp_a sizes whose node holds the attention-side weights plus one sequence's KV cache; raise if none."""
    mod, p = x.model, x.params
    fit = [t for t in tp_a_set if pm.max_sequences(mod, x.attn, t, x.context, p) >= 1]
    if not fit:
        t = max(tp_a_set)
        weights = _gb(pm.attention_weight_bytes(mod, p))
        kv = _gb(pm.kv_bytes_per_sequence(mod, x.context, p))
        usable = _gb(pm.usable_memory(x.attn, t, p))
        raise UsageError(
            f"attention memory binds: {mod.name}'s attention weights ({weights} GB) plus the KV cache of one "
            f"{x.context}-token sequence ({kv} GB) do not fit in {t} x {x.attn.name} ({usable} GB usable); "
            "lower --context or choose an --attn-gpu with more memory"
        )
    return fit


def _best(per_cost: np.ndarray, throughput: np.ndarray, gpus: np.ndarray) -> int:
    """Index of the highest throughput per cost; ties go to more throughput, then fewer GPUs."""
    return int(np.lexsort((-gpus, throughput, per_cost))[-1])


def best_disaggregated(
    model: str | Model,
    attn_gpu: str | GPU,
    expert_gpu: str | GPU | None = None,
    tbt_slo_ms: float = DEFAULT_SLO_MS,
    context: int = DEFAULT_CONTEXT,
    *,
    prices: dict[str, float] | None = None,
    params: pm.PerfParams | None = None,
    m: int | None = None,
    n_a: int | None = None,
    tp_a: int | None = None,
    tp_e: int | None = None,
    experts_per_group: int | None = None,
    max_gpus: int = 1024,
) -> Deployment:
    """Best disaggregated deployment of `model` on `attn_gpu` (attention) and `expert_gpu` (experts).

    Args:
        model: catalog name or `Model`.
        attn_gpu: GPU for attention nodes (catalog name or `GPU`).
        expert_gpu: GPU for expert nodes; defaults to `attn_gpu`.
        tbt_slo_ms: time-between-tokens objective, milliseconds.
        context: tokens per sequence whose KV cache must fit (and be read each step).
        prices: overrides of relative prices per GPU-hour, by GPU name.
        params: performance-model factors.
        m, n_a, tp_a, tp_e, experts_per_group: fix that dimension of the search (for sweeps).
        max_gpus: upper bound on the GPUs of one deployment.

    Returns:
        The plan with the highest throughput per cost (ties: more throughput, then fewer GPUs).

    Raises:
        UsageError: unknown names, nonsensical numbers, or no deployment meeting the SLO and
            memory limits (the message says which constraint binds and the best achievable TBT).
    """
    x = _resolve(model, attn_gpu, expert_gpu, tbt_slo_ms, context, prices, params)
    mod, p = x.model, x.params
    node_tp = tuple(t for t in TP_CHOICES if t <= p.gpus_per_node)
    tp_a_set = _choices("--tp-a", tp_a, node_tp)
    tp_e_set = _choices("--tp-e", tp_e, node_tp)
    m_set = _choices("--m", m, MICRO_BATCH_CHOICES)
    n_a_set = _choices("--n-a", n_a, REPLICA_CHOICES if n_a is None else tuple(range(1, max(REPLICA_CHOICES) + 1)))
    epg_set = _choices("--experts-per-group", experts_per_group, _divisors(mod.experts))
    max_gpus = int(_positive_number("max_gpus", max_gpus, "1024"))

    expert_fit = _expert_layouts(x, tp_e_set, epg_set)
    attn_fit = _attention_layouts(x, tp_a_set)

    pairs = np.asarray(expert_fit, dtype=np.float64)
    base = _grid(tp_a=attn_fit, pair=range(len(expert_fit)), m=m_set, n_a=n_a_set)
    index = base.pop("pair").astype(int)
    g = dict(base, tp_e=pairs[index, 0], epg=pairs[index, 1])
    g["n_e"] = mod.experts / g["epg"]
    g["gpus"] = g["n_a"] * g["tp_a"] + g["n_e"] * g["tp_e"]
    keep = g["gpus"] <= max_gpus
    if not np.any(keep):
        raise UsageError(f"max_gpus={max_gpus} is too small for {mod.name}; allow more GPUs")
    g = {k: v[keep] for k, v in g.items()}

    # KV cache bounds the per-node micro-batch: m micro-batches of b_a sequences live on each node.
    kv_limit = np.floor(pm.max_sequences(mod, x.attn, g["tp_a"], x.context, p) / g["m"])
    upper = np.clip(kv_limit, 0, MAX_BATCH_PER_NODE)
    b = _binary_search(lambda bb, rows: _disaggregated_times(x, g, bb, rows)["tbt"], upper, x.slo_s)
    feasible = b >= 1
    if not np.any(feasible):
        _raise_slo(x, g, upper, "disaggregated")

    t = _disaggregated_times(x, g, np.maximum(b, 1))
    batch = g["m"] * g["n_a"] * b
    throughput = np.where(feasible, batch / t["tbt"], 0.0)
    cost = g["n_a"] * g["tp_a"] * x.attn.price + g["n_e"] * g["tp_e"] * x.expert.price
    per_cost = throughput / cost
    best = _best(per_cost, throughput, g["gpus"])
    binding = _binding(b[best], kv_limit[best])
    pick = {k: float(v[best]) for k, v in g.items()}
    return _deployment(
        x, "disaggregated", x.expert,
        layout=dict(tp_a=pick["tp_a"], tp_e=pick["tp_e"], n_a=pick["n_a"], n_e=pick["n_e"],
                    experts_per_group=pick["epg"], m=pick["m"], B=batch[best], b_a=b[best], gpus=pick["gpus"]),
        tokens_per_expert=float(t["tokens_per_expert"][best]),
        times_s=dict(t_attn=t["t_attn"][best], t_expert=t["t_expert"][best], t_comm=t["t_comm"][best],
                     t_other=t["t_other"][best], tbt=t["tbt"][best]),
        throughput=float(throughput[best]), cost=float(cost[best]), binding=binding,
        attn_bytes=pm.attention_weight_bytes(mod, p)
        + pick["m"] * b[best] * pm.kv_bytes_per_sequence(mod, x.context, p),
        expert_bytes=pm.expert_weight_bytes(mod, pick["epg"], p),
    )


def _deployment(x: _Inputs, deployment: str, expert_gpu: GPU, *, layout: dict[str, Any], tokens_per_expert: float,
               times_s: dict[str, Any], throughput: float, cost: float, binding: str, attn_bytes: float,
               expert_bytes: float) -> Deployment:
    """The one place a `Deployment` is built: integer layout, stage times in ms, derived throughput figures."""
    fields = {name: int(value) for name, value in layout.items()}
    return Deployment(
        model=x.model.name,
        deployment=deployment,
        attn_gpu=x.attn.name,
        expert_gpu=expert_gpu.name,
        **fields,
        tokens_per_expert=round(tokens_per_expert, 2),
        **{f"{name}_ms": float(value) * 1e3 for name, value in times_s.items()},
        tbt_slo_ms=x.slo_s * 1e3,
        context=x.context,
        throughput_tokens_s=throughput,
        throughput_per_gpu=throughput / fields["gpus"],
        cost_per_hour=cost,
        throughput_per_cost=throughput / cost,
        binding_constraint=binding,
        attn_memory_gb=_gb(attn_bytes),
        expert_memory_gb=_gb(expert_bytes),
    )


def _binding(batch: float, kv_limit: float) -> str:
    if batch >= MAX_BATCH_PER_NODE:
        return "batch_cap"
    if batch >= kv_limit:
        return "kv_cache_memory"
    return "tbt_slo"


def _raise_slo(x: _Inputs, g: dict[str, np.ndarray], upper: np.ndarray, deployment: str) -> None:
    """No configuration serves even one sequence per micro-batch: say why and what is achievable."""
    if not np.any(upper >= 1):
        kv = _gb(pm.kv_bytes_per_sequence(x.model, x.context, x.params))
        raise UsageError(
            f"attention memory binds: no {deployment} layout of {x.model.name} on {x.attn.name} has room for the "
            f"KV cache of one {x.context}-token sequence ({kv} GB) per micro-batch; lower --context or use an "
            "--attn-gpu with more memory"
        )
    ones = np.ones_like(upper)
    if deployment == "disaggregated":
        tbt = _disaggregated_times(x, g, ones)["tbt"]
    else:
        tbt = pm.colocated_step_time(x.model, x.attn, g["tp"], g["groups"], ones, x.context, x.params)[3]
    tbt = np.where(upper >= 1, tbt, np.inf)
    best = float(np.min(tbt)) * 1e3
    raise UsageError(
        f"tbt_slo binds: no {deployment} deployment of {x.model.name} on {x.attn.name}+{x.expert.name} meets "
        f"--tbt-slo-ms {x.slo_s * 1e3:g}; the best achievable time between tokens is {best:.2f} ms (one "
        f"sequence per micro-batch); raise --tbt-slo-ms to at least {math.ceil(best * 100) / 100:g} or use faster GPUs"
    )


def best_colocated(
    model: str | Model,
    gpu: str | GPU,
    tbt_slo_ms: float = DEFAULT_SLO_MS,
    context: int = DEFAULT_CONTEXT,
    *,
    prices: dict[str, float] | None = None,
    params: pm.PerfParams | None = None,
    tp: int | None = None,
    max_gpus: int = 1024,
) -> Deployment:
    """Best colocated EP deployment (baseline): every TP group runs attention and holds `E/groups` experts.

    Each decode step runs attention, all-to-all, experts and all-to-all per layer with no overlap,
    like the colocated engines the paper compares against. Searches TP size, EP groups (divisors of
    E) and the per-group batch; the fields `tp_a = tp_e`, `n_a = n_e` (groups), `m = 1`.
    """
    x = _resolve(model, gpu, None, tbt_slo_ms, context, prices, params)
    mod, p = x.model, x.params
    tp_set = _choices("--tp", tp, tuple(t for t in TP_CHOICES if t <= p.gpus_per_node))
    max_gpus = int(_positive_number("max_gpus", max_gpus, "1024"))
    g = _grid(tp=tp_set, groups=_divisors(mod.experts))
    g["gpus"] = g["tp"] * g["groups"]
    expert_bytes = pm.expert_weight_bytes(mod, mod.experts / g["groups"], p)
    keep = (g["gpus"] <= max_gpus) & (pm.usable_memory(x.attn, g["tp"], p) > expert_bytes)
    if not np.any(keep):
        raise UsageError(
            f"memory binds: no colocated layout of {mod.name} on up to {max_gpus} x {x.attn.name} holds its weights; "
            "choose a GPU with more memory or allow more GPUs"
        )
    g = {k: v[keep] for k, v in g.items()}
    kv_limit = pm.max_sequences(mod, x.attn, g["tp"], x.context, p, extra_weights=expert_bytes[keep])
    upper = np.clip(kv_limit, 0, MAX_BATCH_PER_NODE)

    def step(bb: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return pm.colocated_step_time(mod, x.attn, g["tp"][rows], g["groups"][rows], bb, x.context, p)[3]

    b = _binary_search(step, upper, x.slo_s)
    feasible = b >= 1
    if not np.any(feasible):
        _raise_slo(x, g, upper, "colocated")
    t_attn, t_expert, t_comm, tbt = pm.colocated_step_time(
        mod, x.attn, g["tp"], g["groups"], np.maximum(b, 1), x.context, p
    )
    batch = b * g["groups"]
    throughput = np.where(feasible, batch / tbt, 0.0)
    cost = g["gpus"] * x.attn.price
    per_cost = throughput / cost
    best = _best(per_cost, throughput, g["gpus"])
    groups, tp_best = int(g["groups"][best]), int(g["tp"][best])
    return _deployment(
        x, "colocated", x.attn,
        layout=dict(tp_a=tp_best, tp_e=tp_best, n_a=groups, n_e=groups, experts_per_group=mod.experts // groups,
                    m=1, B=batch[best], b_a=b[best], gpus=g["gpus"][best]),
        tokens_per_expert=float(b[best] * groups * mod.top_k / mod.experts),
        times_s=dict(t_attn=t_attn[best], t_expert=t_expert[best], t_comm=t_comm[best],
                     t_other=tbt[best] - mod.moe_layers * (t_attn[best] + t_expert[best] + 2 * t_comm[best]),
                     tbt=tbt[best]),
        throughput=float(throughput[best]), cost=float(cost[best]), binding=_binding(b[best], kv_limit[best]),
        attn_bytes=pm.attention_weight_bytes(mod, p) + expert_bytes[keep][best]
        + b[best] * pm.kv_bytes_per_sequence(mod, x.context, p),
        expert_bytes=expert_bytes[keep][best],
    )


def compare(
    model: str | Model,
    gpus: Iterable[str] | None = None,
    tbt_slo_ms: float = DEFAULT_SLO_MS,
    context: int = DEFAULT_CONTEXT,
    *,
    prices: dict[str, float] | None = None,
    params: pm.PerfParams | None = None,
    colocated: bool = True,
) -> list[dict[str, Any]]:
    """Deployment every (attention GPU, expert GPU) pair from `gpus` and, with `colocated`, each GPU alone.

    Returns:
        One dict per deployment, best throughput per cost first. A deployment that cannot meet the
        SLO or memory limits appears last, with its `error` instead of numbers.
    """
    names = list(GPUS) if gpus is None else [get_gpu(n, flag="--gpus", prices=prices).name for n in gpus]
    if not names:
        raise UsageError("--gpus is empty; list at least one GPU, e.g. --gpus H20,L40S")
    rows: list[dict[str, Any]] = []
    ok_rows: list[dict[str, Any]] = []
    jobs: list[tuple[str, str, str]] = [("disaggregated", a, e) for a in names for e in names]
    if colocated:
        jobs += [("colocated", n, n) for n in names]
    for deployment, a, e in jobs:
        try:
            if deployment == "colocated":
                result = best_colocated(model, a, tbt_slo_ms, context, prices=prices, params=params)
            else:
                result = best_disaggregated(model, a, e, tbt_slo_ms, context, prices=prices, params=params)
            ok_rows.append(result.to_dict())
        except UsageError as exc:
            rows.append({"deployment": deployment, "attn_gpu": a, "expert_gpu": e, "error": str(exc)})
    ok_rows.sort(key=lambda r: r["throughput_per_cost"], reverse=True)
    return ok_rows + rows


def simulate_deployment(result: Deployment) -> Timeline:
    """Run the simulator on a disaggregated plan's ping-pong schedule (all MoE layers).

    The makespan plus `t_other_ms` equals `tbt_ms`: the planner's closed form and the simulator are
    the same model.

    Returns:
        The timeline, in milliseconds.
    """
    from mbridge_epoverlap.schedule.costs import serving_costs
    from mbridge_epoverlap.schedule.resources import DISAGGREGATED_RESOURCES
    from mbridge_epoverlap.schedule.serving_orders import ping_pong
    from mbridge_epoverlap.schedule.simulator import simulate

    if result.deployment != "disaggregated":
        raise UsageError(f"only disaggregated plans run the ping-pong schedule; this one is {result.deployment}")
    layers = get_model(result.model).moe_layers
    costs = serving_costs(result.t_attn_ms, result.t_expert_ms, result.t_comm_ms)
    return simulate(ping_pong(result.m, layers), costs, DISAGGREGATED_RESOURCES)
