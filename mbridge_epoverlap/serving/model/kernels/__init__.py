"""The model room's compiled kernels: arithmetic torch has no fast path for, in C, built here at first use.

- `small_gemm`: fp32 GEMMs of one to a few rows on tiled weights (a decode step's small experts, one call a
  layer), the same bits on every CPU; its source `small_gemm.c` is compiled with the system's C compiler and
  cached, and where it cannot be built the callers keep oneDNN.

Nothing is imported here, so importing the package stays cheap.
"""
