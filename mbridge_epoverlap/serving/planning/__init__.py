"""The planning room: the offline deployment planner (MegaScale-Infer's Algorithm 1), no processes, no torch.

- `catalog`: GPUs and MoE models, with where each number comes from.
- `perf_model`: MegaScale-Infer's roofline performance model of one micro-batch in one layer.
- `search`: the deployment search over TP sizes, replicas, micro-batches and batch, and the colocated
  baseline; `mbridge-epoverlap plan` (`serving.cli.plan`) prints what it finds.
- `ablations`: MegaScale-Infer's ablations (micro-batches, attention replicas, heterogeneous GPUs, colocation)
  replayed through the search, each figure beside the paper's.
- `to_engine`: a planned deployment as the engine's layout flags, shrunk to the machine's worker processes
  (`plan --engine-workers N`).

Nothing is imported here, so importing the package stays cheap.
"""
