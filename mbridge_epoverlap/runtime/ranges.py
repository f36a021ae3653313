"""Named ranges for profiles: `torch.profiler.record_function` always, NVTX as well on CUDA.

Range names are the stage names of the layer program (`attn`, `experts`, `post`, `post_bwd`, ...);
communication ranges are `<stage>.issue` / `<stage>.wait` (`dispatch.issue`, `combine_bwd.wait`, ...), so
every communication range contains "dispatch" or "combine" and profile analyzers can classify them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _load_nvtx() -> Any:
    try:
        import nvtx  # optional: only useful under Nsight Systems
    except ImportError:
        return None
    return nvtx


class Ranges:
    """Opens a profiler range (and an NVTX range on CUDA) around a block."""

    def __init__(self, *, use_nvtx: bool) -> None:
        self._nvtx = _load_nvtx() if use_nvtx else None

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(name):
            if self._nvtx is None:
                yield
            else:
                with self._nvtx.annotate(name, domain="mbridge_epoverlap"):
                    yield
