"""Self-checks of the runtime on the current layout (`worker --mode check`), the correctness yardstick.

1. Schedules: plain 1F1B, plain with delayed wgrad, combined 1F1B, combined with delayed wgrad, and the
   latter in Megatron-Core's order (first forward and last backward alone) with every all-to-all on one
   communication channel, train the same model on the same data for a few iterations, in fp32 and bf16.
   Losses and every gradient
   (before and after the data-parallel reduction) must be bitwise identical; the report carries exact
   digests so the comparison happens wherever the report is read.
2. Reference: the staged executor against the unscheduled model (`MoEGPT.forward`, ordinary autograd
   with synchronous all-to-alls): the same numbers up to rounding.
3. Dispatcher: a dispatch/combine round trip with uneven splits and experts that receive no tokens
   returns each token scaled by the sum of its router weights, delivers every row to the right expert,
   and its backward (the inverse all-to-alls) gives the matching input gradient.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.moe.dispatcher import AllToAllDispatcher
from mbridge_epoverlap.moe.router import Routing
from mbridge_epoverlap.runtime.data import mock_micro_batches
from mbridge_epoverlap.runtime.executor import ScheduleExecutor
from mbridge_epoverlap.runtime.optim import Optimizer, reduce_main_grads, zero_main_grads
from mbridge_epoverlap.runtime.train import RankContext, build_model, num_micro_batches
from mbridge_epoverlap.schedule.training_orders import one_f_one_b

# name: (overlap, delayed wgrad, paired edges, one communication channel)
VARIANTS = {
    "plain": (False, False, True, False),
    "plain_delay_wgrad": (False, True, True, False),
    "combined": (True, False, True, False),
    "combined_delay_wgrad": (True, True, True, False),
    "combined_delay_wgrad_megatron_core_edges_one_channel": (True, True, False, True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def digest(t: torch.Tensor) -> str:
    """Exact fingerprint of a tensor's values."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def run_checks(cfg: RunConfig, ctx: RankContext, *, iterations: int = 2) -> dict[str, Any] | None:
    """Run every check on this rank; rank 0 returns {"ranks": [per-rank report, ...]}, others None."""
    report: dict[str, Any] = {"rank": ctx.groups.rank, "ep": ctx.groups.ep_size, "comm_channels": ctx.comm_channels,
                              "schedules": {}, "reference": {}}
    for dtype_name, dtype in DTYPES.items():
        report["schedules"][dtype_name] = {
            name: _train_variant(cfg, ctx, dtype, overlap, delay, iterations, paired_edges=paired,
                                 one_channel=one_channel)
            for name, (overlap, delay, paired, one_channel) in VARIANTS.items()
        }
        report["reference"][dtype_name] = _against_reference(cfg, ctx, dtype)
    report["dispatcher"] = _dispatcher_round_trip(ctx)
    gathered: list[Any] = [None] * ctx.groups.world
    dist.all_gather_object(gathered, report)
    return {"ranks": gathered} if ctx.groups.rank == 0 else None


def check_failures(report: dict[str, Any], *, fp32_loss_tol: float = 1e-5, fp32_grad_rel_tol: float = 1e-4,
                   bf16_loss_tol: float = 1e-2, dispatcher_tol: float = 1e-5) -> list[str]:
    """What in a `run_checks` report (rank 0's {"ranks": [...]}) is wrong; empty when every check passed.

    Schedules must agree bit for bit; the staged executor and the dispatcher round trip within the given
    tolerances of the unscheduled reference (they sum in another order).
    """
    failures = []
    for r in report["ranks"]:
        rank = r["rank"]
        for dtype, variants in r["schedules"].items():
            plain = variants["plain"]
            losses = [float.fromhex(x) for it in plain["losses"] for x in it]
            if not losses or not all(math.isfinite(x) for x in losses):
                failures.append(f"rank {rank} {dtype}: non-finite loss under plain 1F1B")
            for name, v in variants.items():
                for key in ("losses", "local_grads", "grads", "params"):
                    if v[key] != plain[key]:
                        failures.append(f"rank {rank} {dtype}: {name} {key} differ from plain 1F1B")
        ref = r["reference"]
        if not ref["fp32"]["max_loss_diff"] < fp32_loss_tol:
            failures.append(f"rank {rank}: staged fp32 loss off the reference by {ref['fp32']['max_loss_diff']:.3g}")
        if not ref["fp32"]["max_grad_rel_diff"] < fp32_grad_rel_tol:
            failures.append(f"rank {rank}: staged fp32 gradients off the reference by "
                            f"{ref['fp32']['max_grad_rel_diff']:.3g} (relative)")
        if not ref["bf16"]["max_loss_diff"] < bf16_loss_tol:
            failures.append(f"rank {rank}: staged bf16 loss off the reference by {ref['bf16']['max_loss_diff']:.3g}")
        d = r["dispatcher"]
        if not d["routing_ok"]:
            failures.append(f"rank {rank}: dispatch delivered rows to the wrong experts")
        for key in ("roundtrip_max_err", "grad_max_err"):
            if not d[key] < dispatcher_tol:
                failures.append(f"rank {rank}: dispatcher {key} = {d[key]:.3g}")
    return failures


def _batches(cfg: RunConfig, ctx: RankContext, iteration: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return mock_micro_batches(
        seed=cfg.train.seed, iteration=iteration, dp_rank=ctx.groups.rank,
        num_micro_batches=num_micro_batches(cfg, ctx.groups.world), micro_batch_size=cfg.train.micro_batch_size,
        seq_length=cfg.model.seq_length, vocab_size=cfg.model.vocab_size, device=ctx.device,
    )


def _train_variant(cfg: RunConfig, ctx: RankContext, dtype: torch.dtype, overlap: bool, delay: bool,
                   iterations: int, *, paired_edges: bool = True, one_channel: bool = False) -> dict[str, Any]:
    model = build_model(cfg, replace(ctx, comm_backward=None) if one_channel else ctx, dtype)
    optimizer = Optimizer(model, kind=ctx.options.optimizer, lr=cfg.train.lr)
    micro_batches = num_micro_batches(cfg, ctx.groups.world)
    steps = one_f_one_b(micro_batches, cfg.model.num_layers, overlap=overlap, delay_wgrad=delay,
                        paired_edges=paired_edges)
    executor = ScheduleExecutor(model)
    out: dict[str, Any] = {"losses": [], "local_grads": [], "grads": []}
    for iteration in range(1, iterations + 1):
        losses = executor.run(steps, _batches(cfg, ctx, iteration), loss_scale=1.0 / micro_batches)
        out["losses"].append([float(loss).hex() for loss in losses])
        out["local_grads"].append({name: digest(p.main_grad) for name, p in model.named_parameters()})
        reduce_main_grads(model, ctx.groups, ctx.comm)
        out["grads"].append({name: digest(p.main_grad) for name, p in model.named_parameters()})
        optimizer.step()
        zero_main_grads(model)
    out["params"] = {name: digest(p) for name, p in model.named_parameters()}
    return out


def _against_reference(cfg: RunConfig, ctx: RankContext, dtype: torch.dtype) -> dict[str, float]:
    """Largest differences between the staged combined schedule and plain autograd (one iteration)."""
    micro_batches = num_micro_batches(cfg, ctx.groups.world)
    batches = _batches(cfg, ctx, 1)
    staged = build_model(cfg, ctx, dtype)
    steps = one_f_one_b(micro_batches, cfg.model.num_layers, overlap=True, delay_wgrad=True)
    staged_losses = ScheduleExecutor(staged).run(steps, batches, loss_scale=1.0 / micro_batches)
    reference = build_model(cfg, ctx, dtype)
    ref_losses = []
    for tokens, labels in batches:
        loss = reference(tokens, labels)
        (loss / micro_batches).backward()
        ref_losses.append(loss.detach().float())
    loss_diff = max(abs(float(a) - float(b)) for a, b in zip(staged_losses, ref_losses, strict=True))
    grad_diff = 0.0
    for (name, a), (_, b) in zip(staged.named_parameters(), reference.named_parameters(), strict=True):
        scale = float(b.main_grad.abs().max()) or 1.0
        grad_diff = max(grad_diff, float((a.main_grad - b.main_grad).abs().max()) / scale)
        del name
    return {"max_loss_diff": loss_diff, "max_grad_rel_diff": grad_diff}


def _dispatcher_round_trip(ctx: RankContext) -> dict[str, Any]:
    """Round trip with uneven splits and zero-token experts; every rank derives every rank's routing."""
    ep, ep_rank = ctx.groups.ep_size, ctx.groups.ep_rank
    experts, topk, hidden = 2 * max(ep, 2), 2, 6
    empty = {1, experts - 1}  # these experts receive no tokens from anyone
    candidates = [e for e in range(experts) if e not in empty]

    def routing_of(r: int) -> torch.Tensor:
        tokens = 5 + 3 * r  # uneven token counts per rank
        picks = [[candidates[(t * (r + 2) + j) % len(candidates)] for j in range(topk)] for t in range(tokens)]
        return torch.tensor(picks, dtype=torch.int64)

    chosen = routing_of(ep_rank)
    tokens = chosen.shape[0]
    generator = torch.Generator().manual_seed(ep_rank)
    weights = torch.softmax(torch.randn(tokens, topk, generator=generator), dim=-1)
    # Each row carries (source rank, token index) so the receiver can check where it came from.
    y = torch.randn(tokens, hidden, generator=generator, dtype=torch.float32)
    y[:, 0], y[:, 1] = float(ep_rank), torch.arange(tokens, dtype=torch.float32)
    dispatcher = AllToAllDispatcher(experts, topk, ep, ctx.groups.ep_group, ctx.comm)
    y, weights = y.to(ctx.device), weights.to(ctx.device)
    routing = Routing(experts=chosen.to(ctx.device), weights=weights)

    permuted, handle = dispatcher.permute(y, routing)
    received = dispatcher.dispatch_async(handle, permuted).wait()
    grouped = dispatcher.sort_by_expert(handle, received)
    counts = handle.tokens_per_expert or []
    expected_rows: list[set[tuple[int, int]]] = [set() for _ in counts]
    for r in range(ep):
        for t, row in enumerate(routing_of(r).tolist()):
            for e in row:
                if e // dispatcher.local_experts == ep_rank:
                    expected_rows[e % dispatcher.local_experts].add((r, t))
    routing_ok, start = True, 0
    for local, n in enumerate(counts):
        got = {(int(a), int(b)) for a, b in grouped[start:start + n, :2].tolist()}
        routing_ok &= got == expected_rows[local] and n == len(expected_rows[local])
        start += n
    back = dispatcher.combine_async(handle, dispatcher.unsort_from_expert(handle, grouped)).wait()
    out = dispatcher.unpermute(handle, back, weights)
    expected = y * weights.sum(-1, keepdim=True).to(y.dtype)
    roundtrip_err = float((out - expected).abs().max())

    # The differentiable path: the backward of dispatch and combine are the inverse all-to-alls.
    leaf = y.clone().requires_grad_(True)
    grouped2, handle2 = dispatcher.dispatch(leaf, routing)
    out2 = dispatcher.combine(handle2, grouped2 * 2.0, weights)
    upstream = torch.ones_like(out2)
    out2.backward(upstream)
    grad_err = float((leaf.grad - 2.0 * weights.sum(-1, keepdim=True).to(y.dtype)).abs().max())
    return {
        "tokens": tokens, "send_splits": handle.send_splits, "recv_splits": handle.recv_splits,
        "tokens_per_expert": counts, "zero_token_experts": sorted(empty),
        "routing_ok": bool(routing_ok), "roundtrip_max_err": roundtrip_err, "grad_max_err": grad_err,
    }
