"""Environment variables a run must be launched with, by Megatron-Bridge's rules per target GPU.

They are read by CUDA/HybridEP when the process starts, so they go into the launched environment (the
sbatch script, or the environment the local ranks are started with); setting them from Python inside a
running job has no effect (Megatron-Bridge #925). The GPU facts come from `mbridge_epoverlap.gpus`.
"""

from __future__ import annotations

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.gpus import GPU_FACTS, GpuFacts

FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
HYBRID_EP_RANKS = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"
NVLINK_DOMAIN_SIZE = "NVLINK_DOMAIN_SIZE"
USE_MNNVL = "USE_MNNVL"
HYBRID_EP_TOPOLOGY = (HYBRID_EP_RANKS, NVLINK_DOMAIN_SIZE, USE_MNNVL)


def _facts(gpu: str) -> GpuFacts | None:
    return GPU_FACTS.get(gpu.lower())


def _backend(cfg: RunConfig) -> str | None:
    m = cfg.model
    if m.moe_token_dispatcher_type == "flex" and m.moe_flex_dispatcher_backend in FLEX_BACKENDS:
        return m.moe_flex_dispatcher_backend
    return None


def cuda_device_max_connections(cfg: RunConfig, gpu: str) -> int:
    """32 on Blackwell/VR200 targets; else 1 with TP>1 or CP>1 and no EP overlap; else 32 for a flex backend, 8.

    EP overlap needs more than one hardware queue so the comm stream's kernels are not serialized
    behind the compute stream's; TP/CP comm overlap without EP overlap wants exactly one.
    """
    m = cfg.model
    facts = _facts(gpu)
    if facts is not None and facts.many_connections:
        return 32
    overlap = cfg.comm_overlap.effective_overlap(m)
    if (m.tensor_model_parallel_size > 1 or m.context_parallel_size > 1) and not overlap:
        return 1
    return 32 if _backend(cfg) is not None else 8


def hybrid_ep_topology(cfg: RunConfig, gpu: str) -> dict[str, str]:
    """The HybridEP topology variables, exported with the hybridep backend only.

    8-GPU NVLink domains (H100, B200, B300, ...): min(EP, 8) ranks per domain, no multi-node NVLink.
    NVL72 domains (GB200, GB300, VR200, R100): EP ranks (at most 72), MNNVL on. None without hybridep or on cpu.
    """
    facts = _facts(gpu)
    if _backend(cfg) != "hybridep" or facts is None:
        return {}
    ep = cfg.model.expert_model_parallel_size if cfg.model.expert_model_parallel_size is not None else 1
    if ep <= 0:
        raise UsageError(f"HybridEP needs a positive expert parallel size, got expert_model_parallel_size={ep}; "
                         "use -ep 1 or more")
    domain = facts.nvlink_domain
    if facts.use_mnnvl and ep > domain:
        raise UsageError(f"HybridEP with expert_model_parallel_size={ep} on {facts.key}: EP must not exceed the "
                         f"{domain}-rank NVLink domain; use -ep {domain} or fewer")
    return {HYBRID_EP_RANKS: str(min(ep, domain)), NVLINK_DOMAIN_SIZE: str(domain),
            USE_MNNVL: "1" if facts.use_mnnvl else "0"}


def hybrid_ep_ranks_per_nvlink_domain(cfg: RunConfig, gpu: str) -> int | None:
    """min(EP, NVLink domain) with the hybridep backend; None otherwise."""
    value = hybrid_ep_topology(cfg, gpu).get(HYBRID_EP_RANKS)
    return int(value) if value is not None else None


def launch_environment(cfg: RunConfig, gpu: str) -> tuple[dict[str, str], list[str]]:
    """The variables to export for this run, and warnings.

    The computed values fill in what the config's `env_vars` leave unset; explicit `env_vars` win, with a
    warning when `CUDA_DEVICE_MAX_CONNECTIONS=1` would serialize EP overlap.
    """
    env = {MAX_CONNECTIONS: str(cuda_device_max_connections(cfg, gpu))}
    env.update(hybrid_ep_topology(cfg, gpu))
    warnings: list[str] = []
    env.update({str(k): str(v) for k, v in cfg.env_vars.items()})
    if cfg.comm_overlap.effective_overlap(cfg.model) and env[MAX_CONNECTIONS].strip() == "1":
        warnings.append(f"env_vars.{MAX_CONNECTIONS}=1 serializes the comm and compute streams, so EP overlap "
                        f"cannot overlap anything; drop the override (the harness would use "
                        f"{cuda_device_max_connections(cfg, gpu)})")
    return env, warnings
