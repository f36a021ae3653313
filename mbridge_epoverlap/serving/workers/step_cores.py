"""How one worker process with several cores spreads each step over them.

A step with few tokens (decode, or decode with one prompt joining) is bound by reading the experts' weights, a
few rows each, through many small ops: torch's OpenMP threads there cost more than they give (every small op
waits for its slowest thread, and an idle OpenMP thread spins on the core the other needs), while the experts'
tiled GEMMs (`kernels.small_gemm`) share their tiles among threads of their own and read the weights with every
core. A step with many tokens (a burst of prompts) is bound by the GEMMs' arithmetic, which oneDNN runs fastest on
torch's threads. So a narrow step runs torch on one thread and the tiled GEMMs on every core (every expert, the
head and the attention projections: `packed.tiled_rows`); a wide one, from `WIDE_TOKENS` tokens, runs torch on
every core and the tiled GEMMs on one thread (as a process with that many torch threads always did).

Measured on a 2-core AMD EPYC (Zen 4, avx512_bf16, no AMX), one process, fp32, 10 decoding sequences plus `P`
prompts of 64 tokens, medians of 5 alternated steps (torch on 2 threads / tiled GEMMs on 2 threads, ms): the
108M Qwen3-MoE (64 experts, top-8) 39.1 / 36.8 at P = 1, 59.3 / 66.2 at 2, 235 / 304 at 16; the 57M Mixtral
(8 experts, top-2) 35.6 / 37.8, 40.6 / 60.5, 168 / 272; decode steps alone at 16 sequences 20.0-22.5 ms (torch
on one thread, tiled GEMMs on one) against 14.7-16.5 (tiled GEMMs on two).

Where the experts do not tile (not fp32, shapes off the tile, no compiler) a process keeps torch on every core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mbridge_epoverlap.serving.model.kernels import small_gemm

if TYPE_CHECKING:
    from mbridge_epoverlap.serving.model.spec import ModelSpec

WIDE_TOKENS = 128  # a step with this many tokens or more computes on torch's threads (the docstring's crossover)


def experts_tile(spec: ModelSpec) -> bool:
    """Whether the model's routed experts run on the tiled GEMMs here (fp32, whole tiles, the library built)."""
    return small_gemm.runs_for(spec.torch_dtype(), spec.expert_w1_rows, spec.hidden_size)


class StepCores:
    """Sets torch's and the tiled GEMMs' threads for each step of a worker process with `cores` cores.

    Args:
        cores: the threads the process was given (`--threads`); 1 changes nothing.
        tiles: whether its experts run on the tiled GEMMs (`experts_tile`); False keeps torch on every core.
    """

    def __init__(self, cores: int, tiles: bool) -> None:
        self.tiles = tiles
        self.cores, self.splits = 0, False  # `use` sets both
        self._wide: bool | None = None
        self.use(cores)

    def use(self, cores: int) -> None:
        """Compute on `cores` cores from the next step on (an online server lends an idle process's cores to a
        busy one whose sequences are its own: `online.Cores`)."""
        cores = max(1, cores)
        if cores == self.cores:
            return
        self.cores, self.splits, self._wide = cores, cores > 1 and self.tiles, None
        if not self.splits:
            torch.set_num_threads(cores)
            if self.tiles:  # back from lent cores: the tiled GEMMs' helpers stand down
                small_gemm.set_threads(1)

    def for_step(self, tokens: int) -> None:
        """Before a step of `tokens` tokens: torch on every core from `WIDE_TOKENS`, else the tiled GEMMs."""
        if not self.splits:
            return
        wide = tokens >= WIDE_TOKENS
        if wide == self._wide:
            return
        torch.set_num_threads(self.cores if wide else 1)
        small_gemm.set_threads(1 if wide else self.cores)
        self._wide = wide

    @property
    def summary(self) -> str:
        """What the process does with its cores, for the worker's report."""
        if self.cores == 1:
            return "one thread"
        if not self.splits:
            return f"torch on {self.cores} threads"
        return (f"{self.cores} threads: the tiled expert GEMMs below {WIDE_TOKENS} tokens a step, torch from "
                f"{WIDE_TOKENS}")
