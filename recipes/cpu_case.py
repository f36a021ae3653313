"""One case of the EP-overlap A/B on the reference runtime: a recipe, shrunk for a few CPU processes
(`config.shrink`), with the two overlap switches set."""

from __future__ import annotations

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.shrink import CpuShape, shrink_for_cpu
from mbridge_epoverlap.recipes.loader import load_recipe


def cpu_overlap_case(recipe: str, num_procs: int, *, overlap: bool, delay_wgrad: bool, shape: CpuShape | None = None,
                     ep: int | None = None, task: str = "pretrain") -> RunConfig:
    """One case of the EP-overlap A/B on the reference runtime: `recipe` shrunk for `num_procs` processes with
    the two overlap switches set, finalized.

    Every case gets the same DDP settings: gradient-reduce overlap off, since delayed wgrad with overlapped
    gradient reduction needs Transformer Engine >= 2.7, which a CPU machine lacks (the runtime reduces
    gradients after the last micro-batch either way), so the cases differ only in the overlap switches.
    """
    cfg = load_recipe(recipe, task)
    cfg.comm_overlap.overlap_moe_expert_parallel_comm = overlap
    cfg.comm_overlap.delay_wgrad_compute = delay_wgrad
    cfg.comm_overlap.overlap_grad_reduce = False
    cfg.ddp.overlap_grad_reduce = False
    cfg = shrink_for_cpu(cfg, num_procs, ep=ep, shape=shape)
    cfg.comm_overlap.finalize(cfg.model, cfg.ddp)
    return cfg
