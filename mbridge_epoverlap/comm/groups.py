"""Process-group set-up: the default group with a timeout, and the EP / expert-data-parallel groups.

With TP = PP = CP = 1 every rank is data parallel for the dense part; expert parallelism splits each
block of `ep` consecutive ranks over the experts, and ranks holding the same experts (same position in
their block) form an expert-data-parallel (EDP) group that reduces expert gradients.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mbridge_epoverlap.errors import UsageError


@dataclass
class ParallelGroups:
    """This rank's place in the layout and the groups it communicates in.

    Attributes:
        rank: global rank.
        world: number of ranks.
        ep_size: expert-parallel size.
        ep_rank: rank inside its EP group (selects the experts it holds).
        ep_group: the EP group (dispatch/combine all-to-all).
        edp_group: ranks holding the same experts (expert gradient all-reduce).
        edp_size: size of `edp_group`.
        world_group: all ranks (dense gradient all-reduce, loss, flags).
        ep_backward_group: a second group of the same ranks as `ep_group` for the backward all-to-alls, so they
            travel on their own connections beside the forward ones (None: they share `ep_group`).
    """

    rank: int
    world: int
    ep_size: int
    ep_rank: int
    ep_group: Any
    edp_group: Any
    edp_size: int
    world_group: Any
    ep_backward_group: Any = None


def init_distributed(rank: int, world: int, *, backend: str, timeout_s: float, init_method: str | None = None) -> None:
    """Join the default process group; every collective and the rendezvous time out after `timeout_s`."""
    kwargs: dict[str, Any] = {
        "backend": backend, "rank": rank, "world_size": world, "timeout": timedelta(seconds=timeout_s),
    }
    if init_method is not None:
        kwargs["init_method"] = init_method
    elif "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        # Every rank opens the rendezvous store itself (what env:// would do), so that rank 0's server takes over
        # the listening socket the local launcher held for it (`launch.ranks.STORE_FD_ENV`): no other run can take
        # the port between its pick and the bind.
        from mbridge_epoverlap.comm.store import open_store

        kwargs["store"] = open_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world=world,
                                     is_server=rank == 0, timeout_s=timeout_s)
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(**kwargs)


def build_groups(ep_size: int, *, backward_channel: bool = False) -> ParallelGroups:
    """Create the EP and EDP groups (a collective call: every rank must call it with the same arguments).

    With `backward_channel`, each EP group gets a twin for the backward all-to-alls (`ep_backward_group`).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise UsageError(f"expert_model_parallel_size={ep_size} does not divide the {world} ranks")
    ep_group = edp_group = ep_backward_group = None
    # new_group is collective over the default group: every rank creates every group, in the same order.
    for block in range(world // ep_size):
        ranks = list(range(block * ep_size, (block + 1) * ep_size))
        group = dist.new_group(ranks)
        twin = dist.new_group(ranks) if backward_channel else None
        if rank in ranks:
            ep_group, ep_backward_group = group, twin
    for position in range(ep_size):
        ranks = list(range(position, world, ep_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            edp_group = group
    return ParallelGroups(
        rank=rank, world=world, ep_size=ep_size, ep_rank=rank % ep_size, ep_group=ep_group,
        edp_group=edp_group, edp_size=world // ep_size, world_group=dist.group.WORLD,
        ep_backward_group=ep_backward_group,
    )
