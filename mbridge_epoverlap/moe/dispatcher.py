"""All-to-all token dispatcher over the expert-parallel group, with uneven splits.

One round trip is: permute (local) -> exchange counts + dispatch all-to-all (comm) -> sort by local expert
(local) -> experts -> unsort (local) -> combine all-to-all (comm) -> unpermute with router weights (local).
Local steps never communicate and communication steps never compute, so a schedule can put another
micro-batch's compute between a communication's issue and its wait.

Everything one round trip needs to remember lives in a `DispatchHandle` returned by `permute`, not on the
dispatcher, so any number of micro-batches can be in flight at once. The backward of dispatch is a
combine-shaped all-to-all of gradients and the backward of combine a dispatch-shaped one; the handle
knows both shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mbridge_epoverlap.comm.alltoall import (
    AllToAll,
    CommContext,
    PendingAllToAll,
    all_to_all_async,
    all_to_all_blocking,
    exchange_counts,
)
from mbridge_epoverlap.moe.permute import expand_permute, permute_rows
from mbridge_epoverlap.moe.router import Routing


@dataclass
class DispatchHandle:
    """State of one micro-batch's dispatch/combine through one layer.

    Attributes:
        num_tokens: local tokens T.
        topk: experts per token k.
        order: [T*k] flat (token, slot) positions sorted by global expert, i.e. by destination rank and
            then by that rank's local expert.
        inverse_order: the inverse permutation of `order`.
        send_counts: [ep, local_experts] rows this rank sends to each rank's experts.
        recv_counts: [ep, local_experts] rows this rank receives from each source for each local expert
            (None until the counts were exchanged).
        expert_order: received rows (source-major) sorted by (local expert, source); None before counts.
        expert_inverse: the inverse permutation of `expert_order`.
        send_splits: rows sent to each rank by dispatch (received back by combine); set with the counts.
        recv_splits: rows received from each rank by dispatch (sent back by combine); set with the counts.
        tokens_per_expert: rows for each local expert after `sort_by_expert`; set with the counts.
    """

    num_tokens: int
    topk: int
    order: torch.Tensor
    inverse_order: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor | None = None
    expert_order: torch.Tensor | None = None
    expert_inverse: torch.Tensor | None = None

    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    tokens_per_expert: list[int] | None = None

    def splits(self) -> tuple[list[int], list[int]]:
        """(rows sent to each rank by dispatch, rows received from each rank by dispatch); combine swaps them."""
        if self.send_splits is None or self.recv_splits is None:
            raise RuntimeError("token counts were not exchanged yet (call exchange_counts first)")
        return self.send_splits, self.recv_splits


class AllToAllDispatcher:
    """Routes tokens to the rank holding their experts and back.

    Args:
        num_experts: experts in the layer (E), split evenly over the EP group.
        topk: experts per token.
        ep_size: ranks in the EP group; rank r holds experts [r*E/ep, (r+1)*E/ep).
        group: the EP process group (None for ep_size == 1).
        comm: timeout and CUDA side stream for the collectives.
        backward_channel: (group, comm) of the same ranks for the backward all-to-alls, so that they do not
            queue behind the forward ones (None: they use `group` and `comm`).
    """

    def __init__(self, num_experts: int, topk: int, ep_size: int, group: Any, comm: CommContext, *,
                 backward_channel: tuple[Any, CommContext] | None = None) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_moe_experts={num_experts} is not divisible by expert_model_parallel_size={ep_size}")
        self.num_experts, self.topk, self.ep_size = num_experts, topk, ep_size
        self.local_experts = num_experts // ep_size
        self.group, self.comm = group, comm
        self.backward_group, self.backward_comm = backward_channel or (group, comm)

    # --- local, before communication -------------------------------------------------------------
    def permute(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, DispatchHandle]:
        """Copy each token once per chosen expert, grouped by destination rank and expert.

        Args:
            x: [T, hidden] tokens.
            routing: the router's choice for each token.

        Returns:
            ([T*k, hidden] rows to dispatch, the handle for this micro-batch).
        """
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).view(self.ep_size, self.local_experts)
        handle = DispatchHandle(
            num_tokens=x.shape[0], topk=routing.experts.shape[1], order=order,
            inverse_order=torch.argsort(order), send_counts=counts,
        )
        return expand_permute(x, order, handle.inverse_order, handle.topk), handle

    # --- communication ---------------------------------------------------------------------------
    def exchange_counts(self, handle: DispatchHandle) -> None:
        """Tell every rank how many rows it will receive for each of its experts (small, synchronous)."""
        if self.comm.thread is not None and self.ep_size > 1:
            # Through the communication thread, behind whatever it still has queued, so every rank
            # issues its collectives in the same order.
            PendingAllToAll(future=self.comm.submit(lambda: self._exchange_counts_now(handle)), ctx=self.comm,
                            what="token-count exchange").wait()
        else:
            self._exchange_counts_now(handle)

    def _exchange_counts_now(self, handle: DispatchHandle) -> torch.Tensor:
        handle.recv_counts = exchange_counts(handle.send_counts, self.group, self.comm)
        # One host copy of the sizes per round trip (on CUDA each .tolist() is a device sync).
        handle.send_splits = handle.send_counts.sum(1).tolist()
        handle.recv_splits = handle.recv_counts.sum(1).tolist()
        handle.tokens_per_expert = handle.recv_counts.sum(0).tolist()
        handle.expert_order = _source_to_expert_order(handle.recv_counts)
        handle.expert_inverse = torch.argsort(handle.expert_order)
        return handle.recv_counts

    def dispatch_async(self, handle: DispatchHandle, permuted: torch.Tensor) -> PendingAllToAll:
        """Start sending permuted rows to their experts' ranks (exchanges the counts first if needed).

        With a communication thread both the count exchange and the token all-to-all run there, so the
        caller does not wait for the count round trip; the handle's counts are filled in by `wait()`.
        """
        if self.comm.thread is not None and handle.recv_counts is None and self.ep_size > 1:
            def job() -> torch.Tensor:
                self._exchange_counts_now(handle)
                send, recv = handle.splits()
                return all_to_all_blocking(permuted, send, recv, self.group, self.comm, what="dispatch all-to-all")

            return PendingAllToAll(future=self.comm.submit(job), ctx=self.comm, what="dispatch all-to-all")
        if handle.recv_counts is None:
            self.exchange_counts(handle)
        send, recv = handle.splits()
        return all_to_all_async(permuted, send, recv, self.group, self.comm, what="dispatch all-to-all")

    def combine_async(self, handle: DispatchHandle, expert_out: torch.Tensor) -> PendingAllToAll:
        """Start sending expert outputs (source-major, as received) back to the tokens' ranks."""
        send, recv = handle.splits()
        return all_to_all_async(expert_out, recv, send, self.group, self.comm, what="combine all-to-all")

    def combine_grad_async(self, handle: DispatchHandle, grad_combined: torch.Tensor) -> PendingAllToAll:
        """Backward of combine: gradients travel like a dispatch."""
        send, recv = handle.splits()
        return all_to_all_async(grad_combined, send, recv, self.backward_group, self.backward_comm,
                                what="combine backward all-to-all")

    def dispatch_grad_async(self, handle: DispatchHandle, grad_received: torch.Tensor) -> PendingAllToAll:
        """Backward of dispatch: gradients travel like a combine."""
        send, recv = handle.splits()
        return all_to_all_async(grad_received, recv, send, self.backward_group, self.backward_comm,
                                what="dispatch backward all-to-all")

    # --- local, after communication --------------------------------------------------------------
    @staticmethod
    def sort_by_expert(handle: DispatchHandle, received: torch.Tensor) -> torch.Tensor:
        """Received rows (grouped by source rank) regrouped by local expert; sizes in `handle.tokens_per_expert`."""
        if handle.expert_order is None or handle.expert_inverse is None:
            raise RuntimeError("token counts were not exchanged yet")
        return permute_rows(received, handle.expert_order, handle.expert_inverse)

    @staticmethod
    def unsort_from_expert(handle: DispatchHandle, expert_out: torch.Tensor) -> torch.Tensor:
        """Inverse of `sort_by_expert`: back to source-major order for the combine."""
        if handle.expert_order is None or handle.expert_inverse is None:
            raise RuntimeError("token counts were not exchanged yet")
        return permute_rows(expert_out, handle.expert_inverse, handle.expert_order)

    @staticmethod
    def unpermute(handle: DispatchHandle, combined: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum each token's k expert outputs weighted by the router: [T*k, hidden] -> [T, hidden].

        A gather and a batched [1, k] x [k, hidden] product per token (no scatter-add), so the result is
        deterministic.
        """
        per_slot = permute_rows(combined, handle.inverse_order, handle.order)
        per_slot = per_slot.view(handle.num_tokens, handle.topk, -1)
        return torch.bmm(weights.unsqueeze(1).to(combined.dtype), per_slot).squeeze(1)

    # --- synchronous, differentiable (no overlap) ------------------------------------------------
    def dispatch_sync(self, handle: DispatchHandle, permuted: torch.Tensor) -> torch.Tensor:
        """Exchange counts (if not yet) and send permuted rows to their experts' ranks; autograd sends the
        gradients back. Returns the received rows, source-major."""
        if handle.recv_counts is None:
            self.exchange_counts(handle)
        send, recv = handle.splits()
        return AllToAll.apply(permuted, send, recv, self.group, self.comm)

    def combine_sync(self, handle: DispatchHandle, expert_out: torch.Tensor) -> torch.Tensor:
        """Send expert outputs (source-major, as received) back to the tokens' ranks; differentiable."""
        send, recv = handle.splits()
        return AllToAll.apply(expert_out, recv, send, self.group, self.comm)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, DispatchHandle]:
        """Permute, exchange and sort in one differentiable call; returns (rows by local expert, handle).

        The rows for local expert e are the `handle.tokens_per_expert[e]` rows after those of experts < e.
        """
        permuted, handle = self.permute(x, routing)
        return self.sort_by_expert(handle, self.dispatch_sync(handle, permuted)), handle

    def combine(self, handle: DispatchHandle, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Unsort, send back and unpermute in one differentiable call."""
        combined = self.combine_sync(handle, self.unsort_from_expert(handle, expert_out))
        return self.unpermute(handle, combined, weights)


def _source_to_expert_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """Permutation taking rows grouped by (source, local expert) to rows grouped by (local expert, source)."""
    sources, local_experts = recv_counts.shape
    blocks = torch.arange(sources * local_experts, device=recv_counts.device)
    block_of_row = torch.repeat_interleave(blocks, recv_counts.reshape(-1))
    key = (block_of_row % local_experts) * sources + torch.div(block_of_row, local_experts, rounding_mode="floor")
    return torch.argsort(key, stable=True)
