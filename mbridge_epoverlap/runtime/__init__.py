"""The reference EP MoE runtime: executes the schedules of `mbridge_epoverlap.schedule` for real on
`torch.distributed` (gloo on CPU, NCCL with CUDA streams on GPUs).

`run_local` launches a run in local processes; `python -m mbridge_epoverlap.runtime.worker` is one rank
(for Slurm `srun`). Importing this package does not import torch.
"""

from mbridge_epoverlap.runtime.launch import run_local
from mbridge_epoverlap.runtime.metrics import RunMetrics

__all__ = ["RunMetrics", "run_local"]
