"""Serving MoE models with disaggregated expert parallelism.

- `catalog`: GPUs and models, with sources.
- `perf_model`: MegaScale-Infer's roofline performance model.
- `planner`: deployment search (Algorithm 1) and the colocated baseline; `cli`: `mbridge-epoverlap plan`.

Nothing is imported here, so importing the package (and `mbridge-epoverlap --help`) stays cheap.
"""
