"""Shared pieces of the recipes: the run shape every recipe fills in."""

from __future__ import annotations

from mbridge_epoverlap.config.comm_overlap import CommOverlapConfig
from mbridge_epoverlap.config.container import DDPConfig, RunConfig, TrainConfig
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.errors import UsageError

TASKS = ("pretrain", "sft")


def make_run(name: str, task: str, model: MoEModelConfig, *, num_gpus: int, gpus_per_node: int = 8,
             global_batch_size: int = 1024, micro_batch_size: int = 1) -> RunConfig:
    """A run with the conservative defaults of public recipes: EP overlap and delayed wgrad off."""
    if task not in TASKS:
        raise UsageError(f"unknown task {task!r} for recipe {name}; use one of {', '.join(TASKS)}")
    train = TrainConfig(
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        train_iters=1000 if task == "sft" else 10000,
        lr=5.0e-6 if task == "sft" else 3.0e-4,
    )
    return RunConfig(
        recipe=name,
        task=task,
        num_gpus=num_gpus,
        gpus_per_node=gpus_per_node,
        model=model,
        comm_overlap=CommOverlapConfig(overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False),
        train=train,
        ddp=DDPConfig(overlap_grad_reduce=True, overlap_param_gather=True),
    )
