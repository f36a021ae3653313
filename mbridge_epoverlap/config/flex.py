"""Switching the MoE token dispatcher to flex (DeepEP, HybridEP or NCCL EP) only where the GPU supports it.

Setting `moe_flex_dispatcher_backend` alone does not enable flex: `apply_flex_dispatcher_backend` must
also set the dispatcher type. On an unsupported GPU it says so (a `FlexDispatcherWarning`) and falls back
to alltoall with the backend cleared, as Megatron-Bridge does, or raises with `strict=True`; it never
falls back silently, and a failed CUDA probe is an error, not "no GPU". NCCL EP (`ncclep`) is a backend
from Megatron-Bridge 0.6 (main at 067f987 does not know it yet) on Megatron-Core 0.19 and later.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from mbridge_epoverlap.config.environment import Environment
from mbridge_epoverlap.config.model import model_attr
from mbridge_epoverlap.config.versions import bridge_rules
from mbridge_epoverlap.errors import UsageError

logger = logging.getLogger(__name__)

FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")
# What each backend runs on, as the error names it (Megatron-Bridge 0.6.2's `validate_flex_dispatcher_backend`).
SUPPORTED_GPUS = {"deepep": "Ampere, Hopper, B200, B300",
                  "hybridep": "Ampere, Hopper, Blackwell (B200/B300/GB200/GB300)", "ncclep": "Hopper and Blackwell"}


FLEX_WITHOUT_BACKEND_CRASHES = ("moe_token_dispatcher_type=flex without a backend fails when Megatron-Bridge 0.6 "
                                "builds the model (\"Invalid backend: None\"; main falls back to alltoall, #5740)")


class FlexDispatcherWarning(UserWarning):
    """The flex dispatcher was requested but not applied (unsupported GPU, non-MoE model, bad backend)."""


def backend_supports_gpu(backend: str, env: Environment) -> bool:
    """DeepEP: Ampere/Hopper (sm8x, sm9x), B200, B300. HybridEP: sm8x, sm9x, sm10x (incl. GB200/GB300).
    NCCL EP: Hopper and Blackwell (compute capability major 9 or 10)."""
    major = env.compute_capability[0] if env.compute_capability else None
    name = env.gpu_name or ""
    if backend == "deepep":
        return major in (8, 9) or name.startswith(("NVIDIA B200", "NVIDIA B300"))
    if backend == "hybridep":
        return major in (8, 9, 10)
    if backend == "ncclep":
        return major in (9, 10)
    return False


def flex_backend_problem(backend: str | None, env: Environment) -> str | None:
    """Why `backend` cannot run on the environment's GPU, or None when it can (or no GPU is known)."""
    if backend not in FLEX_BACKENDS:
        return f"moe_flex_dispatcher_backend={backend!r} is not one of {', '.join(FLEX_BACKENDS)}"
    if env.gpu_probe_error is not None:
        return env.gpu_probe_error
    if not env.has_gpu or backend_supports_gpu(backend, env):
        return None
    if env.compute_capability is None:
        # A target whose device facts are not public (VR200, R100): Megatron-Bridge ships HybridEP recipes for
        # VR200 and decides on the device itself; rejecting here would refuse its own recipe.
        return None
    gpu = env.gpu_name or f"compute capability {env.compute_capability}"
    return f"the {backend} flex dispatcher does not support {gpu} (supported: {SUPPORTED_GPUS[backend]})"


def known_backends(env: Environment) -> tuple[str, ...]:
    """The flex backends the environment's Megatron-Bridge release applies (ncclep from 0.6, not on main yet)."""
    return FLEX_BACKENDS if bridge_rules(env.bridge_version).has_ncclep else FLEX_BACKENDS[:2]


def _set(model_cfg: Any, name: str, value: Any) -> None:
    if isinstance(model_cfg, dict):
        model_cfg[name] = value
    else:
        setattr(model_cfg, name, value)


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, FlexDispatcherWarning, stacklevel=3)


def apply_flex_dispatcher_backend(model_config: Any, moe_flex_dispatcher_backend: str | None = None, *,
                                  env: Environment | None = None, strict: bool = False) -> Any:
    """Switch the token dispatcher to flex with the backend where the target GPU supports it.

    Megatron-Bridge's signature (`model_config, moe_flex_dispatcher_backend=None`) and behaviour, plus
    two extras: `env` (check for a cluster's GPU from anywhere) and `strict` (raise instead of falling back).

    Args:
        model_config: a TransformerConfig-like object (changed in place and returned).
        moe_flex_dispatcher_backend: "deepep", "hybridep", "ncclep" (Megatron-Bridge 0.6), or None (no change).
        env: the target environment; None means this machine (`Environment.detect()`). With no GPU
            known (a recipe built on a CPU machine for a cluster) flex is set without probing; a failed
            CUDA probe raises `GpuProbeError` instead of being read as "no GPU".
        strict: raise instead of warning and falling back to alltoall on an unsupported GPU.

    Returns:
        `model_config`. On success its dispatcher is "flex", its backend the given one and
        `moe_shared_expert_overlap` is False (flex and shared-expert overlap are exclusive). On an
        unsupported GPU (not strict) the dispatcher is "alltoall" and the backend None, with a warning.
        Models with `num_moe_experts` None or 0 are skipped with a warning.

    Raises:
        UsageError (a ValueError): unsupported GPU with `strict`, or an invalid backend with `strict`.
        GpuProbeError: probing this machine's GPU failed.
    """
    backend = moe_flex_dispatcher_backend
    if backend is None or str(backend).lower() in ("none", "null", ""):
        return model_config
    backend = str(backend).lower()
    experts = model_attr(model_config, "num_moe_experts")
    if experts is None or experts == 0:
        _warn(f"flex dispatcher ({backend}) requested for a model without experts (num_moe_experts={experts}); "
              "dispatcher unchanged")
        return model_config
    env = env or Environment.detect()
    known = known_backends(env)
    if backend not in known:
        message = (f"moe_flex_dispatcher_backend={backend!r} is not one of {', '.join(known)} (Megatron-Bridge "
                   f"{bridge_rules(env.bridge_version).version}); dispatcher unchanged")
        if strict:
            raise UsageError(message)
        _warn(message)
        return model_config
    env.require_gpu_probe()
    problem = flex_backend_problem(backend, env)
    if problem is not None:
        if strict:
            raise UsageError(f"{problem}; use --moe_flex_dispatcher_backend hybridep or the alltoall dispatcher")
        _warn(f"{problem}; falling back to the alltoall dispatcher")
        _set(model_config, "moe_token_dispatcher_type", "alltoall")
        _set(model_config, "moe_flex_dispatcher_backend", None)
        return model_config
    _set(model_config, "moe_token_dispatcher_type", "flex")
    _set(model_config, "moe_flex_dispatcher_backend", backend)
    _set(model_config, "moe_shared_expert_overlap", False)
    return model_config


def validate_flex_dispatcher_backend(model_config: Any, env: Environment | None = None) -> None:
    """Raise UsageError (a ValueError) when the model uses flex with a backend its GPU cannot run.

    Flex without a backend: as Megatron-Bridge main does (#5740), it becomes alltoall (the model is changed
    in place); Megatron-Bridge 0.6 lets it through to crash at model build ("Invalid backend: None"), so
    for 0.6 this raises before the job starts.
    """
    if model_attr(model_config, "moe_token_dispatcher_type") != "flex":
        return
    env = env or Environment.detect()
    if model_attr(model_config, "moe_flex_dispatcher_backend") is None:
        if not bridge_rules(env.bridge_version).flex_none_falls_back:
            raise UsageError(FLEX_WITHOUT_BACKEND_CRASHES + "; use --moe_flex_dispatcher_backend "
                             "hybridep or model.moe_token_dispatcher_type=alltoall")
        _set(model_config, "moe_token_dispatcher_type", "alltoall")
        return
    env.require_gpu_probe()
    problem = flex_backend_problem(model_attr(model_config, "moe_flex_dispatcher_backend"), env)
    if problem is not None:
        raise UsageError(f"{problem}; use --moe_flex_dispatcher_backend hybridep or "
                         "model.moe_token_dispatcher_type=alltoall")
