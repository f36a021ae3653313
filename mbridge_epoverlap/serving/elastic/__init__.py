"""The elastic room: expert parallelism that survives the loss of expert workers and rebalances their load.

Terms (as DeepSeek's EPLB and vLLM's use them):

- logical expert: one of the model's `num_experts` experts of a layer, what the router picks.
- physical expert (slot): one copy of a logical expert's weights on one expert worker (GPU); slots are
  numbered worker by worker, `slots_per_worker` each.
- redundant expert: a physical slot beyond the first copy of each logical expert (`num_experts +
  redundant` slots in all); a replica that survives when another worker dies, or shares a hot expert's load.
- `phy2log`: `[slots]` the logical expert in each slot (`EMPTY_SLOT` on a dead worker); `log2phy`:
  `[experts, max_replicas]` each expert's slots, padded; `logcnt`: `[experts]` each expert's replica count.

Modules:

- `eplb`: the load balancing, pure functions over tensors (placements, re-placement over survivors,
  migration plans, which replica a token uses, load recording).
- `layout`: `ElasticLayout`, one placement and the alive set, re-solved after a loss or for a load,
  `Router`, and `check_elastic`.
- `incremental`: the re-solve that starts from the placement in force and changes only the slots the
  balance needs (fewer weight moves than a solve from scratch).
- `moves`: expert weights that change owner at a new layout epoch, moved over M2N.
- `sync`: attention workers agreeing at a step boundary on the next epoch (rebalanced, rejoined).
- `workers`: the attention and expert workers that keep decoding through a loss.
- `report`: what an elastic run went through (losses, re-placements, interruption, throughput).

Nothing is imported here, so importing the package stays cheap.
"""
