"""Expert-parallel load balancing (EPLB): where each expert's replicas live, and which replica a token uses.

Pure functions over tensors, no process groups: every rank that calls them with the same load gets
the same placement bit for bit, so survivors of a failure agree on a new placement without
exchanging maps.

- `rebalance_experts`: replicate heavy experts (each extra slot goes to the expert with the highest
  load per replica), then pack replicas heaviest-first into the lightest GPU that still has room.
  The hierarchical policy (expert groups divide by nodes) first packs whole groups onto nodes, so a
  token's experts stay within a node where possible; the global policy packs over all GPUs.
- `rebalance_over_survivors`: the same solve over the GPUs still alive, with the dead GPUs' slots
  left empty (-1), so physical slot ids, and the weights already in them, keep their meaning.
- `orphaned_experts`: experts whose every replica was on a dead GPU (their weights must be restored
  from a copy); `migration_plan`: the weight copies from one placement to the next (from a live
  replica, or from a copy); `check_elastic_layout`: the capacity check to run before start.
- `group_nodes`: the node count for the hierarchical policy given a model's routing groups and the GPUs.
- `logical_maps`: `log2phy` and `logcnt` derived from a `phy2log` table (the engine's router indexes them).
- `choose_replicas`: the replica a token's expert runs on: its position modulo the replica count;
  `slot_gpus` and `experts_on_gpus` turn slots into workers and a placement into what each loads.
- `ExpertLoadRecorder`: per-layer token counts per expert over a sliding window of steps.
- `gpu_loads` / `imbalance`: the load each GPU gets under a placement, and max/mean.
- `contiguous_placement`, `greedy_placement`, `zipf_load`: the baselines and skewed loads that tests
  and `benchmarks/eplb_bench.py` compare against.

Physical slots are laid out GPU by GPU: GPU `g` holds slots `g * s .. g * s + s - 1` with
`s = num_replicas // num_gpus`. The terms (logical, physical and redundant experts; `phy2log`, `log2phy`,
`logcnt`) are defined at the top of the package docstring (`serving.elastic`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from mbridge_epoverlap.errors import UsageError

EMPTY_SLOT = -1  # phy2log entry of a slot on a dead GPU; log2phy padding


class ReplicaMaps(NamedTuple):
    """The maps one solve produces, for every MoE layer.

    Attributes:
        phy2log: `[layers, num_replicas]`, the logical expert in each physical slot (`EMPTY_SLOT` for
            a slot on a dead GPU).
        log2phy: `[layers, logical_experts, max_replicas]`, each expert's physical slots in
            increasing order, padded with `EMPTY_SLOT`.
        logcnt: `[layers, logical_experts]`, each expert's replica count.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor


# ---------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------


def _as_load(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise UsageError(f"EPLB load `weight` must be a [layers, logical_experts] tensor, got {shape}; "
                         "pass one row of per-expert token counts per MoE layer")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise UsageError(f"EPLB load `weight` has shape {tuple(weight.shape)}; it needs at least one layer and "
                         "one logical expert")
    load = weight.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all() or (load < 0).any():
        raise UsageError("EPLB load `weight` holds negative or non-finite values; pass token counts (>= 0)")
    return load


def _check_layout(num_logical: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"EPLB setting {name}={value!r} must be a positive integer")
    if num_replicas < num_logical:
        raise UsageError(f"EPLB num_replicas={num_replicas} is below the {num_logical} logical experts; every "
                         f"expert needs a slot: use num_replicas >= {num_logical} (logical experts plus "
                         "redundant ones)")
    if num_replicas % num_gpus:
        raise UsageError(f"EPLB num_replicas={num_replicas} does not divide over num_gpus={num_gpus}; every GPU "
                         "holds the same number of slots: make num_replicas a multiple of num_gpus "
                         f"(e.g. {(num_replicas // num_gpus + 1) * num_gpus})")
    if num_gpus % num_nodes:
        raise UsageError(f"EPLB num_gpus={num_gpus} does not divide over num_nodes={num_nodes}; every node holds "
                         "the same number of GPUs: fix num_nodes or num_gpus")
    if num_logical % num_groups:
        raise UsageError(f"EPLB num_groups={num_groups} does not divide the {num_logical} logical experts; use the "
                         "model's expert-group count (1 when it has no groups)")


def check_elastic_layout(num_logical_experts: int, num_replicas: int, num_gpus: int, max_lost_gpus: int) -> None:
    """Fail before start when losing `max_lost_gpus` GPUs would leave an expert without a slot.

    Args:
        num_logical_experts: experts per MoE layer in the model.
        num_replicas: physical slots over all GPUs (logical plus redundant experts).
        num_gpus: expert GPUs (workers) at start.
        max_lost_gpus: how many of them the run must survive losing.

    Raises:
        UsageError: the layout does not divide, no GPU would survive, or the survivors' slots would not
            hold every logical expert; the message names the setting and the value that works.
    """
    _check_layout(num_logical_experts, num_replicas, 1, 1, num_gpus)
    if max_lost_gpus < 0:
        raise UsageError(f"kill/lost GPU count {max_lost_gpus} must be >= 0")
    survivors = num_gpus - max_lost_gpus
    if survivors < 1:
        raise UsageError(f"losing {max_lost_gpus} of {num_gpus} expert GPUs leaves none to serve; lose at most "
                         f"{num_gpus - 1} or add expert GPUs")
    slots_per_gpu = num_replicas // num_gpus
    if slots_per_gpu * survivors < num_logical_experts:
        need = -(-num_logical_experts // survivors) * num_gpus
        raise UsageError(f"{survivors} surviving GPUs x {slots_per_gpu} slots = {slots_per_gpu * survivors} slots "
                         f"cannot hold the {num_logical_experts} logical experts after losing {max_lost_gpus}; "
                         f"raise the redundant experts so num_replicas >= {need} "
                         f"(redundant experts >= {need - num_logical_experts}) or lose fewer GPUs")


# ---------------------------------------------------------------------------------------------------
# The two steps: replicate, then pack
# ---------------------------------------------------------------------------------------------------


def replicate_experts(load: torch.Tensor, num_physical: int, cap: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Give every expert one slot, then each extra slot to the expert with the highest load per replica.

    Args:
        load: `[rows, experts]` load (float64).
        num_physical: slots per row (>= experts).
        cap: with `cap > 0`, an expert gets a replica beyond `cap` only once every expert of its row has `cap`:
            the hierarchical policy replicates within a node of `cap` GPUs, where one more replica would share
            a GPU with another and balance nothing.

    Returns:
        `(phy2log [rows, num_physical], logcnt [rows, experts])`; ties go to the lower expert id.
    """
    rows, experts = load.shape
    phy2log = torch.empty(rows, num_physical, dtype=torch.long)
    phy2log[:, :experts] = torch.arange(experts)
    logcnt = torch.ones(rows, experts, dtype=torch.long)
    row_ids = torch.arange(rows)
    for slot in range(experts, num_physical):
        per_replica = load / logcnt
        if cap > 0:
            capped = logcnt >= cap
            room = ~capped.all(dim=1, keepdim=True)
            per_replica = torch.where(capped & room, torch.tensor(-1.0, dtype=load.dtype), per_replica)
        hottest = torch.argmax(per_replica, dim=1)  # first maximum on ties: deterministic
        phy2log[:, slot] = hottest
        logcnt[row_ids, hottest] += 1
    return phy2log, logcnt


def balanced_packing(load: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Place items heaviest-first into the lightest pack that still has room; every pack gets as many.

    Args:
        load: `[rows, items]` load (float64); `items` must be a multiple of `num_packs`.
        num_packs: packs per row.

    Returns:
        `(pack [rows, items], rank_in_pack [rows, items])`; ties go to the lower item and pack id.
    """
    rows, items = load.shape
    per_pack = items // num_packs
    if per_pack == 1:
        # One item per pack: any bijection is balanced; the identity keeps maps simple.
        ids = torch.arange(items).expand(rows, items).clone()
        return ids, torch.zeros_like(ids)
    order = torch.sort(load, dim=1, descending=True, stable=True).indices
    pack = torch.empty(rows, items, dtype=torch.long)
    rank = torch.empty(rows, items, dtype=torch.long)
    pack_load = torch.zeros(rows, num_packs, dtype=load.dtype)
    pack_count = torch.zeros(rows, num_packs, dtype=torch.long)
    row_ids = torch.arange(rows)
    full = torch.tensor(float("inf"), dtype=load.dtype)
    for i in range(items):
        item = order[:, i]
        target = torch.argmin(torch.where(pack_count < per_pack, pack_load, full), dim=1)
        pack[row_ids, item] = target
        rank[row_ids, item] = pack_count[row_ids, target]
        pack_load[row_ids, target] += load[row_ids, item]
        pack_count[row_ids, target] += 1
    return pack, rank


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1)).expand_as(perm).contiguous())
    return inv


def logical_maps(phy2log: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log2phy, logcnt)` from `phy2log`; empty slots are skipped; each expert's slots in increasing order.

    Args:
        phy2log: `[layers, num_physical]` int64, the logical expert in each slot (`EMPTY_SLOT` for none).
        num_logical: logical experts per layer.

    Returns:
        `log2phy` `[layers, num_logical, max_replicas]` int64 padded with `EMPTY_SLOT`, and `logcnt`
        `[layers, num_logical]` int64 (the `ReplicaMaps` fields).
    """
    layers, num_physical = phy2log.shape
    alive = phy2log >= 0
    logcnt = torch.zeros(layers, num_logical, dtype=torch.long)
    logcnt.scatter_add_(1, phy2log.clamp(min=0), alive.long())
    max_replicas = max(int(logcnt.max()), 1)
    log2phy = torch.full((layers, num_logical * max_replicas + 1), EMPTY_SLOT, dtype=torch.long)
    # Sort slots by (expert, slot id); empty slots sort last and land in a spill column dropped below.
    key = torch.where(alive, phy2log, num_logical) * num_physical + torch.arange(num_physical)
    slots = torch.sort(key, dim=1).indices
    experts = phy2log.gather(1, slots)
    first = torch.cumsum(logcnt, dim=1) - logcnt  # index of each expert's first slot in the sorted order
    replica = torch.arange(num_physical) - first.gather(1, experts.clamp(min=0))
    column = torch.where(experts >= 0, experts * max_replicas + replica, num_logical * max_replicas)
    log2phy.scatter_(1, column, slots)
    return log2phy[:, :-1].reshape(layers, num_logical, max_replicas), logcnt


# ---------------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------------


def _solve(load: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> torch.Tensor:
    """phy2log for the hierarchical policy; the global policy is the case of one group on one node."""
    layers, num_logical = load.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes

    # 1. Whole expert groups onto nodes.
    group_load = load.view(layers, num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    # Node-local ("middle") expert id: node n holds middle ids n*E/N .. (n+1)*E/N - 1.
    group_mid = group_node * groups_per_node + group_rank
    log2mid = ((group_mid * group_size).unsqueeze(-1) + torch.arange(group_size)).flatten(-2)
    mid2log = _inverse(log2mid)

    # 2. Replicate within each node.
    mid_load = load.gather(1, mid2log).view(layers * num_nodes, num_logical // num_nodes)
    phy2mid, midcnt = replicate_experts(mid_load, slots_per_node, cap=gpus_per_node if num_nodes > 1 else 0)

    # 3. Replicas onto the node's GPUs, by load per replica.
    replica_load = (mid_load / midcnt).gather(1, phy2mid)
    gpu, rank = balanced_packing(replica_load, gpus_per_node)
    slot_in_node = gpu * (slots_per_node // gpus_per_node) + rank
    node_slot2mid = phy2mid.gather(1, _inverse(slot_in_node))
    node_offset = (torch.arange(num_nodes) * (num_logical // num_nodes)).view(1, -1, 1)
    phy2mid_global = (node_slot2mid.view(layers, num_nodes, -1) + node_offset).flatten(-2)
    return mid2log.gather(1, phy2mid_global)


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> ReplicaMaps:
    """Place `num_replicas` expert replicas on `num_gpus` GPUs so each GPU gets about the same load.

    Hierarchical when `num_groups` divides by `num_nodes` (groups packed onto nodes first, then
    replicas within each node), global otherwise. Deterministic: ties always go to the lower id.

    Args:
        weight: `[layers, logical_experts]` load per expert (token counts), any numeric dtype.
        num_replicas: physical slots over all GPUs, a multiple of `num_gpus`, >= logical experts.
        num_groups: expert groups (the model's routing groups; 1 when it has none).
        num_nodes: nodes the GPUs are spread over.
        num_gpus: GPUs holding experts.

    Returns:
        `ReplicaMaps(phy2log, log2phy, logcnt)` with shapes `[layers, num_replicas]`,
        `[layers, logical_experts, max_replicas]` and `[layers, logical_experts]`.

    Raises:
        UsageError: a load that is not `[layers, experts]` counts or a layout that does not divide.
    """
    load = _as_load(weight)
    num_logical = load.shape[1]
    _check_layout(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log = _solve(load, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log = _solve(load, num_replicas, 1, 1, num_gpus)
    log2phy, logcnt = logical_maps(phy2log, num_logical)
    return ReplicaMaps(phy2log, log2phy, logcnt)


def group_nodes(num_groups: int, num_gpus: int, num_slots: int, num_logical: int, num_hosts: int = 1) -> int:
    """The node count the hierarchical policy should use for a model routed in `num_groups` expert groups
    (1: use the global policy).

    A group-limited router (DeepSeek-V3, GLM-4.5) sends a token's experts to at most `topk_group` groups, so
    with each group's experts on one node a token's choices reach at most that many nodes. The nodes are:

    - the hosts, when the GPUs span `num_hosts > 1` of them and the groups and GPUs divide over the hosts
      (then a group staying on a host keeps its tokens off the link between hosts);
    - otherwise sets of GPUs on one host: the most equal sets both the groups and the GPUs divide into (so a
      group count that divides the GPUs gives a node of GPUs per group, and GPUs that divide the groups a node
      of groups per GPU). With redundant slots a node keeps at least two GPUs where it can: the replicas are
      made within a node, and a second replica on the same GPU balances nothing.

    Args:
        num_groups: the model's routing groups (`GroupedRouting.n_group`; 1 without).
        num_gpus: GPUs (expert workers) at start.
        num_slots: physical slots over all of them.
        num_logical: logical experts per layer.
        num_hosts: hosts the GPUs are spread over, evenly.
    """
    if num_groups <= 1 or num_logical % num_groups:
        return 1
    if num_hosts > 1:
        return num_hosts if num_groups % num_hosts == 0 and num_gpus % num_hosts == 0 else 1
    redundant = num_slots > num_logical
    for nodes in range(math.gcd(num_groups, num_gpus), 1, -1):
        if num_groups % nodes or num_gpus % nodes:
            continue
        # a GPU holds distinct experts of its node only; a replica needs a second GPU in the node
        if num_logical // nodes >= num_slots // num_gpus and (not redundant or num_gpus // nodes >= 2):
            return nodes
    return 1


def _alive_list(alive_gpus: Iterable[int], num_gpus: int) -> list[int]:
    alive = sorted(set(int(g) for g in alive_gpus))
    if not alive:
        raise UsageError("no expert GPU survives; an elastic run needs at least one live expert worker")
    bad = [g for g in alive if not 0 <= g < num_gpus]
    if bad:
        raise UsageError(f"alive GPU ids {bad} are outside 0..{num_gpus - 1} (num_gpus={num_gpus})")
    return alive


def rebalance_over_survivors(weight: torch.Tensor, num_replicas: int, num_gpus: int, alive_gpus: Iterable[int],
                             num_groups: int = 1, num_nodes: int = 1) -> ReplicaMaps:
    """Re-solve the placement over the GPUs still alive; dead GPUs keep their slot ids, left empty.

    The survivors hold `num_replicas // num_gpus` slots each, as before. The hierarchical policy is
    kept when every node still has the same number of live GPUs; otherwise the global one is used
    (a node that lost a GPU can no longer take an equal share of groups). Every survivor computes the
    same result from the same `weight` and alive set.

    Args:
        weight: `[layers, logical_experts]` load per expert.
        num_replicas: physical slots at start, over all `num_gpus` GPUs.
        num_gpus: expert GPUs at start.
        alive_gpus: ids (0-based) of the GPUs still alive.
        num_groups: expert groups (1 when the model has none).
        num_nodes: nodes at start (GPUs `n * num_gpus // num_nodes ...` are on node `n`).

    Returns:
        `ReplicaMaps` with `num_replicas` physical slots; slots of dead GPUs hold `EMPTY_SLOT` and appear
        in no `log2phy` row.

    Raises:
        UsageError: no survivor, an unknown GPU id, or survivors' slots fewer than the logical experts
            (the message names the experts that would have no slot, per layer, lightest first).
    """
    load = _as_load(weight)
    layers, num_logical = load.shape
    _check_layout(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    alive = _alive_list(alive_gpus, num_gpus)
    slots_per_gpu = num_replicas // num_gpus
    survivor_slots = slots_per_gpu * len(alive)
    if survivor_slots < num_logical:
        missing = num_logical - survivor_slots
        lightest = torch.sort(load, dim=1, stable=True).indices[:, :missing]
        named = "; ".join(f"layer {layer}: {lightest[layer].tolist()}" for layer in range(min(layers, 4)))
        more = f" (and {layers - 4} more layers)" if layers > 4 else ""
        raise UsageError(f"{len(alive)} surviving GPUs x {slots_per_gpu} slots = {survivor_slots} slots cannot hold "
                         f"the {num_logical} logical experts; {missing} experts per layer would have no replica "
                         f"({named}{more}); run with more redundant experts or more expert GPUs")
    gpus_per_node = num_gpus // num_nodes
    alive_per_node = [sum(1 for g in alive if g // gpus_per_node == n) for n in range(num_nodes)]
    if len(set(alive_per_node)) == 1 and num_groups % num_nodes == 0:
        compact = _solve(load, survivor_slots, num_groups, num_nodes, len(alive))
    else:
        compact = _solve(load, survivor_slots, 1, 1, len(alive))
    phy2log = torch.full((layers, num_replicas), EMPTY_SLOT, dtype=torch.long)
    for index, gpu in enumerate(alive):
        phy2log[:, gpu * slots_per_gpu:(gpu + 1) * slots_per_gpu] = \
            compact[:, index * slots_per_gpu:(index + 1) * slots_per_gpu]
    log2phy, logcnt = logical_maps(phy2log, num_logical)
    return ReplicaMaps(phy2log, log2phy, logcnt)


def orphaned_experts(phy2log: torch.Tensor, num_gpus: int, alive_gpus: Iterable[int]) -> dict[int, list[int]]:
    """Experts whose every replica was on a dead GPU: their weights must come from a copy.

    Args:
        phy2log: `[layers, num_replicas]` placement in force when the GPUs died.
        num_gpus: expert GPUs in that placement.
        alive_gpus: ids of the GPUs still alive.

    Returns:
        `{layer: [logical expert ids]}` for the layers that lost some expert entirely (empty when none).
    """
    layers, num_physical = phy2log.shape
    alive = _alive_list(alive_gpus, num_gpus)
    slots_per_gpu = num_physical // num_gpus
    slot_alive = torch.zeros(num_physical, dtype=torch.bool)
    for gpu in alive:
        slot_alive[gpu * slots_per_gpu:(gpu + 1) * slots_per_gpu] = True
    num_logical = int(phy2log.max()) + 1
    held = torch.zeros(layers, num_logical, dtype=torch.long)
    placed = phy2log >= 0
    held.scatter_add_(1, phy2log.clamp(min=0), (placed & slot_alive).long())
    existed = torch.zeros(layers, num_logical, dtype=torch.long)
    existed.scatter_add_(1, phy2log.clamp(min=0), placed.long())
    lost = (held == 0) & (existed > 0)
    return {layer: torch.nonzero(lost[layer]).flatten().tolist() for layer in range(layers) if lost[layer].any()}


class Move(NamedTuple):
    """One expert's weights to put into one physical slot when a new placement takes over.

    Attributes:
        layer: MoE layer.
        slot: the physical slot to fill.
        expert: the logical expert it will hold.
        source: a live slot of the old placement that holds the expert (on the same GPU when there is
            one), or None: no live replica, the weights come from a host-memory or on-disk copy.
    """

    layer: int
    slot: int
    expert: int
    source: int | None


def migration_plan(old_phy2log: torch.Tensor, new_phy2log: torch.Tensor, num_gpus: int,
                   alive_gpus: Iterable[int] | None = None) -> list[Move]:
    """The weight copies that turn the old placement into the new one; slots that keep their expert move nothing.

    Deterministic (layer, then slot order; the lowest source slot among equals), so every survivor
    derives the same plan. Sources name the old placement's contents: read every source before
    overwriting any slot (two slots may swap experts).

    Args:
        old_phy2log: `[layers, num_replicas]` placement in force (before the failure or rebalance).
        new_phy2log: `[layers, num_replicas]` placement to switch to (same slot layout).
        num_gpus: GPUs the slots are laid out over.
        alive_gpus: GPUs whose old slots can still be read (default: all).
    """
    if old_phy2log.shape != new_phy2log.shape:
        raise UsageError(f"old and new placements differ in shape ({tuple(old_phy2log.shape)} vs "
                         f"{tuple(new_phy2log.shape)}); re-solve with the same num_replicas")
    alive = set(range(num_gpus)) if alive_gpus is None else set(_alive_list(alive_gpus, num_gpus))
    per_gpu = old_phy2log.shape[1] // num_gpus
    moves = []
    for layer, (old_row, new_row) in enumerate(zip(old_phy2log.tolist(), new_phy2log.tolist(), strict=True)):
        readable = [slot // per_gpu in alive for slot in range(len(old_row))]
        holders: dict[int, list[int]] = {}
        for slot, expert in enumerate(old_row):
            if expert != EMPTY_SLOT and readable[slot]:
                holders.setdefault(expert, []).append(slot)
        for slot, expert in enumerate(new_row):
            if expert == EMPTY_SLOT or (readable[slot] and old_row[slot] == expert):
                continue
            sources = holders.get(expert, [])
            local = [s for s in sources if s // per_gpu == slot // per_gpu]
            moves.append(Move(layer, slot, expert, (local or sources or [None])[0]))
    return moves


# ---------------------------------------------------------------------------------------------------
# Routing to replicas, and measuring the result
# ---------------------------------------------------------------------------------------------------


def choose_replicas(expert_ids: torch.Tensor, positions: torch.Tensor, log2phy: torch.Tensor,
                    logcnt: torch.Tensor) -> torch.Tensor:
    """The physical slot each token's expert runs on: replica `position % replica count`.

    Deterministic, needs no communication, and spreads consecutive tokens of one expert over its
    replicas evenly.

    Args:
        expert_ids: `[tokens, top_k]` logical experts chosen by the router for one layer.
        positions: `[tokens]` each token's position (in the sequence or the batch; any stable integer).
        log2phy: `[logical_experts, max_replicas]` for that layer.
        logcnt: `[logical_experts]` for that layer.

    Returns:
        `[tokens, top_k]` physical slot ids.

    Raises:
        UsageError: an expert with no live replica (the placement must be re-solved first).
    """
    counts = logcnt.to(expert_ids.device)[expert_ids]
    if (counts == 0).any():
        dead = sorted(set(expert_ids[counts == 0].tolist()))
        raise UsageError(f"experts {dead} have no live replica in this placement; re-solve it with "
                         "rebalance_over_survivors before routing")
    replica = positions.to(expert_ids.device).view(-1, 1) % counts
    return log2phy.to(expert_ids.device)[expert_ids, replica]


def experts_on_gpus(phy2log: torch.Tensor, num_gpus: int) -> list[list[int]]:
    """What each GPU (worker) holds under one layer's placement: its slots' logical experts, in slot order.

    An engine whose workers hold the same experts in every layer solves once for all layers, with the
    load summed over layers (`rebalance_experts(load.sum(0, keepdim=True), ...)`), and loads these
    lists; an empty list is a dead GPU.

    Args:
        phy2log: `[num_replicas]` (one layer's row).
        num_gpus: GPUs the slots are laid out over.
    """
    slots = phy2log.view(num_gpus, -1).tolist()
    return [[expert for expert in row if expert != EMPTY_SLOT] for row in slots]


def slot_gpus(slots: torch.Tensor, num_replicas: int, num_gpus: int) -> torch.Tensor:
    """The GPU (worker) of each physical slot id, e.g. of `choose_replicas`' result."""
    return torch.div(slots, num_replicas // num_gpus, rounding_mode="floor")


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """`[layers, num_gpus]` load per GPU, each expert's load split evenly over its replicas.

    Args:
        weight: `[layers, logical_experts]` load.
        phy2log: `[layers, num_replicas]` placement (`EMPTY_SLOT` slots carry nothing).
        num_gpus: GPUs the slots are laid out over.
    """
    load = _as_load(weight)
    layers, num_physical = phy2log.shape
    placed = phy2log >= 0
    logcnt = torch.zeros_like(load, dtype=torch.long)
    logcnt.scatter_add_(1, phy2log.clamp(min=0), placed.long())
    per_replica = load / logcnt.clamp(min=1)
    slot_load = torch.where(placed, per_replica.gather(1, phy2log.clamp(min=0)), 0.0)
    return slot_load.view(layers, num_gpus, num_physical // num_gpus).sum(-1)


def imbalance(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int,
              alive_gpus: Iterable[int] | None = None) -> torch.Tensor:
    """`[layers]` max/mean GPU load (1.0 is perfect balance), over `alive_gpus` when given."""
    loads = gpu_loads(weight, phy2log, num_gpus)
    if alive_gpus is not None:
        loads = loads[:, _alive_list(alive_gpus, num_gpus)]
    mean = loads.mean(dim=1)
    return torch.where(mean > 0, loads.max(dim=1).values / mean.clamp(min=1e-30), torch.ones_like(mean))


# ---------------------------------------------------------------------------------------------------
# Baselines and synthetic loads (for tests and benchmarks)
# ---------------------------------------------------------------------------------------------------


def contiguous_placement(num_layers: int, num_logical_experts: int) -> torch.Tensor:
    """No rebalancing: `[layers, experts]` phy2log with expert `e` in slot `e` (experts in id order per GPU)."""
    return torch.arange(num_logical_experts).expand(num_layers, num_logical_experts).clone()


def greedy_placement(weight: torch.Tensor, num_replicas: int, num_gpus: int) -> torch.Tensor:
    """The replicate-then-pack baseline: the `num_replicas - experts` heaviest experts get one extra
    replica each, then replicas go heaviest-first to the lightest GPU with room. Returns phy2log."""
    load = _as_load(weight)
    layers, experts = load.shape
    _check_layout(experts, num_replicas, 1, 1, num_gpus)
    if num_replicas > 2 * experts:
        raise UsageError(f"the greedy baseline gives at most one extra replica per expert: num_replicas="
                         f"{num_replicas} must be <= {2 * experts}")
    extra = torch.sort(load, dim=1, descending=True, stable=True).indices[:, :num_replicas - experts]
    replicas = torch.cat([contiguous_placement(layers, experts), extra], dim=1)
    counts = torch.ones(layers, experts, dtype=torch.long).scatter_add_(1, extra, torch.ones_like(extra))
    gpu, rank = balanced_packing((load / counts).gather(1, replicas), num_gpus)
    phy2log = torch.empty_like(replicas)
    phy2log.scatter_(1, gpu * (num_replicas // num_gpus) + rank, replicas)
    return phy2log


def zipf_load(num_layers: int, num_logical_experts: int, exponent: float = 1.2, tokens: int = 100_000,
              seed: int = 0) -> torch.Tensor:
    """`[layers, experts]` token counts drawn from a Zipf law (rank `r` gets weight `r**-exponent`),
    with a different expert order in each layer; reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, num_logical_experts + 1, dtype=torch.float64).pow(-exponent)
    rows = []
    for _ in range(num_layers):
        draws = torch.multinomial(probs / probs.sum(), tokens, replacement=True, generator=gen)
        counts = torch.bincount(draws, minlength=num_logical_experts)
        rows.append(counts[torch.randperm(num_logical_experts, generator=gen)])
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------------
# Load recording
# ---------------------------------------------------------------------------------------------------


class ExpertLoadRecorder:
    """Tokens routed to each logical expert, per MoE layer, over the last `window` steps.

    Call `record(layer, expert_ids)` for each layer of a step, then `advance()` once per step; `load()`
    is the `[layers, logical_experts]` sum over the window, the `weight` for `rebalance_experts`.
    """

    def __init__(self, num_layers: int, num_logical_experts: int, window: int) -> None:
        """Args:
            num_layers: MoE layers.
            num_logical_experts: experts per layer.
            window: steps kept (older steps drop out).
        """
        for name, value in (("num_layers", num_layers), ("num_logical_experts", num_logical_experts),
                            ("window", window)):
            if value < 1:
                raise UsageError(f"ExpertLoadRecorder {name}={value} must be >= 1")
        self._counts = torch.zeros(window, num_layers, num_logical_experts, dtype=torch.long)
        self._current = 0
        self.steps = 0  # steps closed by `advance`, for callers that rebalance every N steps

    @property
    def window(self) -> int:
        return self._counts.shape[0]

    def record(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Count the tokens routed in `layer` this step.

        Args:
            layer: MoE layer index.
            expert_ids: logical expert ids, any shape (e.g. the router's `[tokens, top_k]`).
        """
        num_layers, num_logical = self._counts.shape[1:]
        if not 0 <= layer < num_layers:
            raise UsageError(f"layer {layer} is outside 0..{num_layers - 1} of this load recorder")
        ids = expert_ids.detach().reshape(-1).to("cpu", torch.long)
        if ids.numel() and (ids.min() < 0 or ids.max() >= num_logical):
            raise UsageError(f"expert ids must be in 0..{num_logical - 1}, got {ids.min()}..{ids.max()}")
        self._counts[self._current, layer] += torch.bincount(ids, minlength=num_logical)

    def advance(self) -> None:
        """Close the current step; the oldest step in the window is dropped."""
        self._current = (self._current + 1) % self.window
        self._counts[self._current].zero_()
        self.steps += 1

    def load(self) -> torch.Tensor:
        """`[layers, logical_experts]` token counts over the window (the open step included)."""
        return self._counts.sum(dim=0)
