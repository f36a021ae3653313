"""Environment variables a run must be launched with.

Both are read by CUDA/HybridEP when the process starts, so they go into the launched environment (the
sbatch script, or the environment the local ranks are started with); setting them from Python inside a
running job has no effect (Megatron-Bridge #925).
"""

from __future__ import annotations

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.environment import GPU_CATALOG

BLACKWELL = ("b200", "b300", "gb200", "gb300")
FLEX_BACKENDS = ("deepep", "hybridep")
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
HYBRID_EP_RANKS = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"


def cuda_device_max_connections(cfg: RunConfig, gpu: str) -> int:
    """32 for DeepEP/HybridEP or Blackwell; 1 only with TP>1 or CP>1 and no EP overlap; else 8.

    EP overlap needs more than one hardware queue so the comm stream's kernels are not serialized
    behind the compute stream's; TP/CP comm overlap without EP overlap wants exactly one.
    """
    m = cfg.model
    flex = m.moe_token_dispatcher_type == "flex" and m.moe_flex_dispatcher_backend in FLEX_BACKENDS
    if flex or gpu in BLACKWELL:
        return 32
    overlap = cfg.comm_overlap.effective_overlap(m)
    if (m.tensor_model_parallel_size > 1 or m.context_parallel_size > 1) and not overlap:
        return 1
    return 8


def hybrid_ep_ranks_per_nvlink_domain(cfg: RunConfig, gpu: str) -> int | None:
    """min(EP, NVLink domain): 8 on HGX systems (h100/b200/b300 ...), 72 on GB200/GB300 NVL72; None on cpu."""
    spec = GPU_CATALOG.get(gpu)
    if spec is None:
        return None
    return max(1, min(cfg.model.expert_model_parallel_size, spec.nvlink_domain))


def launch_environment(cfg: RunConfig, gpu: str) -> tuple[dict[str, str], list[str]]:
    """The variables to export for this run, and warnings.

    The computed values fill in what the config's `env_vars` leave unset; an explicit
    `env_vars.CUDA_DEVICE_MAX_CONNECTIONS` wins, with a warning when it would serialize EP overlap.
    """
    env = {MAX_CONNECTIONS: str(cuda_device_max_connections(cfg, gpu))}
    ranks = hybrid_ep_ranks_per_nvlink_domain(cfg, gpu)
    if ranks is not None:
        env[HYBRID_EP_RANKS] = str(ranks)
    warnings: list[str] = []
    env.update({str(k): str(v) for k, v in cfg.env_vars.items()})
    if cfg.comm_overlap.effective_overlap(cfg.model) and env[MAX_CONNECTIONS].strip() == "1":
        warnings.append(f"env_vars.{MAX_CONNECTIONS}=1 serializes the comm and compute streams, so EP overlap "
                        f"cannot overlap anything; drop the override (the harness would use "
                        f"{cuda_device_max_connections(cfg, gpu)})")
    return env, warnings
