"""Environment variables a run must be launched with, by Megatron-Bridge's rules per target GPU.

They are read by CUDA/HybridEP when the process starts, so they go into the launched environment (the
sbatch script, or the environment the local ranks are started with); setting them from Python inside a
running job has no effect (Megatron-Bridge #925). The GPU facts come from `mbridge_epoverlap.gpus`.

`CUDA_DEVICE_MAX_CONNECTIONS` of a GPU job follows Megatron-Bridge's `run_script.py`
(`scripts/performance/utils/overrides.py: _apply_flat_cli_environment_compatibility`): the recipe's own
value (its `env_vars`; none: CUDA's default) stays unless `-tp`, `-cp` or `--moe_a2a_overlap` is given, and
then it is recomputed from the recipe's flex backend as the recipe set it, before any flag. The harness's
A/B cases that switch EP overlap count as `--moe_a2a_overlap` (each case is the run that flag would give).
Without a recipe (`-g cpu`) the value is always computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.gpus import GPU_FACTS, GpuFacts

FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")
# The recipe backends after which run_script.py asks for 32 connections (NCCL EP is not among them upstream).
MANY_CONNECTION_BACKENDS = ("deepep", "hybridep")
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
HYBRID_EP_RANKS = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"
NVLINK_DOMAIN_SIZE = "NVLINK_DOMAIN_SIZE"
USE_MNNVL = "USE_MNNVL"
HYBRID_EP_TOPOLOGY = (HYBRID_EP_RANKS, NVLINK_DOMAIN_SIZE, USE_MNNVL)


@dataclass(frozen=True)
class RecipeLaunch:
    """What a GPU job's recipe brings to its launch environment, read before any override or flag.

    Attributes:
        env_vars: the recipe's launch environment (Megatron-Bridge's perf recipes carry one).
        backend: the recipe's `moe_flex_dispatcher_backend`, whatever its dispatcher (upstream reads it so).
        overlap: the recipe's `comm_overlap.overlap_moe_expert_parallel_comm`.
    """

    env_vars: dict[str, str] = field(default_factory=dict)
    backend: str | None = None
    overlap: bool = False


def _facts(gpu: str) -> GpuFacts | None:
    return GPU_FACTS.get(gpu.lower())


def _backend(cfg: RunConfig) -> str | None:
    m = cfg.model
    if m.moe_token_dispatcher_type == "flex" and m.moe_flex_dispatcher_backend in FLEX_BACKENDS:
        return m.moe_flex_dispatcher_backend
    return None


def cuda_device_max_connections(cfg: RunConfig, gpu: str, *, base_backend: str | None = None,
                                base_overlap: bool | None = None) -> int:
    """32 on Blackwell/VR200 targets; else 1 with TP>1 or CP>1 and no EP overlap; else 32 for DeepEP/HybridEP, 8.

    EP overlap needs more than one hardware queue so the comm stream's kernels are not serialized
    behind the compute stream's; TP/CP comm overlap without EP overlap wants exactly one. `base_backend`
    is the recipe's flex backend (default: the config's own), `base_overlap` the EP overlap to judge by
    (default: the config's effective one).
    """
    m = cfg.model
    facts = _facts(gpu)
    if facts is not None and facts.many_connections:
        return 32
    overlap = cfg.comm_overlap.effective_overlap(m) if base_overlap is None else base_overlap
    if (m.tensor_model_parallel_size > 1 or m.context_parallel_size > 1) and not overlap:
        return 1
    backend = _backend(cfg) if base_backend is None else base_backend
    return 32 if backend in MANY_CONNECTION_BACKENDS else 8


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


def launch_environment(cfg: RunConfig, gpu: str, *, recipe: RecipeLaunch | None = None, reconnect: bool = False,
                       overlap_set: bool = True) -> tuple[dict[str, str], list[str]]:
    """The variables to export for this run, and warnings.

    Without `recipe` (`-g cpu`), `CUDA_DEVICE_MAX_CONNECTIONS` is computed. With the GPU job's recipe, the
    recipe's `env_vars` come first and its connection count stays unless `reconnect` (-tp, -cp or
    --moe_a2a_overlap given, or the case switching EP overlap), which recomputes it from the recipe's flex
    backend and EP overlap: the config's where `overlap_set` (--moe_a2a_overlap or the case set it), else the
    recipe's, even when a dotted override changed it (upstream reads the flag, then the recipe). The HybridEP
    topology is computed for a hybridep run. The config's own `env_vars` (the user's `env_vars.*` overrides)
    win over all of these, with a warning when `CUDA_DEVICE_MAX_CONNECTIONS=1` would serialize EP overlap.
    """
    if recipe is None:
        computed = cuda_device_max_connections(cfg, gpu)
        env = {MAX_CONNECTIONS: str(computed)}
    else:
        computed = cuda_device_max_connections(cfg, gpu, base_backend=recipe.backend or "",
                                               base_overlap=None if overlap_set else recipe.overlap)
        env = {str(k): str(v) for k, v in recipe.env_vars.items()}
        if reconnect:
            env[MAX_CONNECTIONS] = str(computed)
    env.update(hybrid_ep_topology(cfg, gpu))
    warnings: list[str] = []
    env.update({str(k): str(v) for k, v in cfg.env_vars.items()})
    if cfg.comm_overlap.effective_overlap(cfg.model) and env.get(MAX_CONNECTIONS, "").strip() == "1":
        if MAX_CONNECTIONS in cfg.env_vars:
            where, fix = f"env_vars.{MAX_CONNECTIONS}=1", f"drop the override (the harness would use {computed})"
        else:
            where, fix = (f"the recipe's {MAX_CONNECTIONS}=1", f"give --moe_a2a_overlap true (recomputes it: "
                          f"{computed}) or env_vars.{MAX_CONNECTIONS}={computed}")
        warnings.append(f"{where} serializes the comm and compute streams, so EP overlap cannot overlap "
                        f"anything; {fix}")
    return env, warnings
