"""The model room's compiled kernels: arithmetic torch has no fast path for, in C, built here at first use.

- `small_gemm`: fp32 GEMMs of one to a few rows on tiled weights (a decode step's small experts, one call a
  layer), the same bits on every CPU; where it cannot be built the callers keep oneDNN.
- `combine`: a MoE layer's gate-weighted sum of each token's expert outputs plus its residual in one pass, the
  bits of the torch loop it replaces (`parts.gate_weighted_sum`), which runs where it cannot be built.
- `build`: compiling a kernel's C source (`small_gemm.c`, `combine.c`) with the system's C compiler, cached per
  source, compiler and CPU.

Nothing is imported here, so importing the package stays cheap.
"""
