"""Row permutations whose backward is a gather too (no zero fill, no scatter-add).

`index_select`'s backward scatters gradients into a zero tensor; when the index is a permutation, the
backward is just the gather by the inverse permutation, which is cheaper and trivially deterministic.
`expand_permute` copies each token once per chosen expert; its backward gathers the copies back and sums
them over k in a fixed order.
"""

from __future__ import annotations

from typing import Any

import torch


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`x[perm]` for a permutation `perm` whose inverse is `inverse`."""
    return _Permute.apply(x, perm, inverse)


class _ExpandPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return x.index_select(0, torch.div(order, topk, rounding_mode="floor"))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (inverse,) = ctx.saved_tensors
        per_slot = grad.index_select(0, inverse).view(-1, ctx.topk, grad.shape[-1])
        return per_slot.sum(dim=1), None, None, None


def expand_permute(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
    """Rows `x[order[i] // topk]`: token t once per slot (t, j), in the slot order `order` ([T*k] permutation
    of the flat (token, slot) positions, `inverse` its inverse)."""
    return _ExpandPermute.apply(x, order, inverse, topk)
