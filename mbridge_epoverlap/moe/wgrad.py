"""Weight gradients that can be computed later: a store of closures and a linear layer that uses it.

The backward of a layer is split in two: dgrad (gradients of the inputs, needed right away by the layer
below) and wgrad (gradients of the weights, needed only by the optimizer). While a store is capturing,
`backward` computes dgrad and queues wgrad as a closure under a key; `flush(key)` runs the queue later,
for instance while an all-to-all is in flight. Outside a capture the closure runs at once, so the same
modules work for ordinary autograd.

Every weight gradient is added into `param.main_grad` (fp32, as with Megatron's gradient accumulation
fusion) when the parameter has one, else into `param.grad`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class WeightGradStore:
    """Queues of deferred weight-gradient closures, one queue per key (e.g. (micro_batch, layer, "experts"))."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, list[Callable[[], None]]] = {}
        self._capturing: Hashable | None = None

    @contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Queue the wgrad closures produced inside this block under `key` instead of running them."""
        if self._capturing is not None:
            raise RuntimeError(f"already capturing weight gradients for {self._capturing!r}")
        self._capturing = key
        try:
            yield
        finally:
            self._capturing = None

    def put(self, fn: Callable[[], None], *, part: Hashable | None = None) -> None:
        """Queue `fn` under the current capture key (under `(key, part)` when `part` is given, so that a later
        step can run that part on its own), or run it now when nothing is capturing."""
        if self._capturing is None:
            with torch.no_grad():
                fn()
        else:
            key = self._capturing if part is None else (self._capturing, part)
            self._queues.setdefault(key, []).append(fn)

    def flush(self, key: Hashable) -> int:
        """Run and drop the closures queued under `key`, in the order they were queued; return how many."""
        queue = self._queues.pop(key, [])
        # Closures run outside autograd's backward: keep them from recording a graph.
        with torch.no_grad():
            for fn in queue:
                fn()
        return len(queue)

    def pending(self) -> list[Hashable]:
        """Keys that still have queued closures."""
        return list(self._queues)

    def clear(self) -> None:
        self._queues.clear()


_DEFAULT_STORE = WeightGradStore()
# The `part` under which grouped experts queue their down-projection weight gradient (`experts_wgrad_down`).
DOWN_PROJECTION = "down"


def default_store() -> WeightGradStore:
    """The process-wide store the modules of this package queue into."""
    return _DEFAULT_STORE


def accumulate_weight_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` into `param.main_grad` (fp32) if present, else into `param.grad`."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype).clone()
    else:
        param.grad.add_(grad)


class _DeferredWgradLinear(torch.autograd.Function):
    """y = x W^T; backward returns dx and hands dW to the store."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store = store
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            dy = grad_out.reshape(-1, grad_out.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])

            def wgrad() -> None:
                accumulate_weight_grad(weight, dy.t().matmul(x2))

            ctx.store.put(wgrad)
        return grad_in, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore | None = None) -> torch.Tensor:
    """`F.linear(x, weight)` whose weight gradient goes through `store` (the default store if None)."""
    return _DeferredWgradLinear.apply(x, weight, store or _DEFAULT_STORE)


class Linear(torch.nn.Module):
    """A bias-free linear layer with deferrable weight gradient.

    Attributes:
        wgrad_store: where its weight-gradient closures go (the default store if None); the executor of a
            schedule points it at its own store with `use_weight_grad_store`.
    """

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.wgrad_store: WeightGradStore | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.wgrad_store)


def use_weight_grad_store(module: torch.nn.Module, store: WeightGradStore) -> int:
    """Point every submodule of `module` that defers weight gradients (has `wgrad_store`) at `store`.

    Returns:
        How many submodules now queue into `store`.
    """
    count = 0
    for sub in module.modules():
        if hasattr(sub, "wgrad_store"):
            sub.wgrad_store = store
            count += 1
    return count
