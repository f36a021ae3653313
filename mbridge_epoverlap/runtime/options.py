"""Run-time options that are not part of the model config, read from the environment.

They travel as environment variables so that the same settings reach ranks started by `run_local` (via
`RunConfig.env_vars`) and by Slurm `srun`:

    MBRIDGE_EPOVERLAP_DTYPE           fp32 | bf16: the compute dtype (unset: the config's precision, but fp32
                                      on a CPU without native bf16; see `config.cpu_precision`)
    MBRIDGE_EPOVERLAP_CPU_FLAGS       replaces the CPU flags of /proc/cpuinfo in that choice (tests)
    MBRIDGE_EPOVERLAP_OPTIMIZER       adam (default) | sgd
    MBRIDGE_EPOVERLAP_COMM_TIMEOUT_S  seconds any collective may take before the run fails (default 120)
    MBRIDGE_EPOVERLAP_DEVICE          auto (default) | cpu | cuda
    MBRIDGE_EPOVERLAP_BACKEND         auto (default: nccl on CUDA unless ranks share a GPU, else gloo) |
                                      nccl | gloo
    MBRIDGE_EPOVERLAP_COMM_NICE       nice value for the CPU communication threads (default -10; 0 leaves
                                      them alone; lowering it needs root)
    MBRIDGE_EPOVERLAP_COMM_CHANNELS   2 (default): on CPU, backward all-to-alls get their own communication
                                      thread and process group beside the forward ones; 1: one for both
    MBRIDGE_EPOVERLAP_SPLIT_EXPERT_WGRAD  1: with delayed wgrad, the experts' down-projection weight gradient runs in
                                      the next combine-backward window; 0 (default): with the rest of the expert
                                      weight gradient
    MBRIDGE_EPOVERLAP_PAIRED_EDGES    1 (default): with EP overlap the first two forwards and the last two
                                      backwards of an iteration run interleaved; 0: Megatron-Core's order
                                      (the first forward and the last backward alone)
    MBRIDGE_EPOVERLAP_FAULT           RANK:MODE:ITERATION, a test hook: at the start of ITERATION (1-based)
                                      rank RANK exits (exit), raises (raise) or stops responding (hang)
    MBRIDGE_EPOVERLAP_HEARTBEAT_DIR   where ranks leave heartbeat files for the launcher's watchdog
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from mbridge_epoverlap.errors import UsageError

PREFIX = "MBRIDGE_EPOVERLAP_"
FAULT_MODES = ("exit", "raise", "hang")


@dataclass(frozen=True)
class Fault:
    """An injected failure (tests of the failure handling)."""

    rank: int
    mode: str
    iteration: int

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.split(":")
        if len(parts) != 3 or parts[1] not in FAULT_MODES or not parts[0].isdigit() or not parts[2].isdigit():
            raise UsageError(f"{PREFIX}FAULT={text!r}: expected RANK:MODE:ITERATION with MODE in {FAULT_MODES}")
        return cls(rank=int(parts[0]), mode=parts[1], iteration=int(parts[2]))


@dataclass(frozen=True)
class RuntimeOptions:
    """See the module docstring for the environment variable of each field."""

    dtype: str | None = None
    optimizer: str = "adam"
    comm_timeout_s: float = 120.0
    device: str = "auto"
    backend: str = "auto"
    comm_nice: int = -10
    paired_edges: bool = True
    comm_channels: int = 2
    split_expert_wgrad: bool = False
    fault: Fault | None = None
    heartbeat_dir: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RuntimeOptions:
        env = os.environ if env is None else env
        dtype = env.get(PREFIX + "DTYPE") or None
        if dtype not in (None, "fp32", "bf16"):
            raise UsageError(f"{PREFIX}DTYPE={dtype!r}: use fp32 or bf16")
        optimizer = _choice(env, "OPTIMIZER", "adam", ("adam", "sgd"), "adam or sgd")
        device = _choice(env, "DEVICE", "auto", ("auto", "cpu", "cuda"), "auto, cpu or cuda")
        backend = _choice(env, "BACKEND", "auto", ("auto", "nccl", "gloo"), "auto, nccl or gloo")
        try:
            timeout = float(env.get(PREFIX + "COMM_TIMEOUT_S", "120"))
        except ValueError:
            raise UsageError(f"{PREFIX}COMM_TIMEOUT_S={env[PREFIX + 'COMM_TIMEOUT_S']!r} is not a number") from None
        try:
            nice = int(env.get(PREFIX + "COMM_NICE", "-10"))
        except ValueError:
            raise UsageError(f"{PREFIX}COMM_NICE={env[PREFIX + 'COMM_NICE']!r} is not an integer") from None
        paired = _choice(env, "PAIRED_EDGES", "1", ("0", "1"),
                         "1 (pair the first forwards and last backwards) or 0 (Megatron-Core's order)")
        channels = _choice(env, "COMM_CHANNELS", "2", ("1", "2"), "2 (forward and backward all-to-alls on separate "
                           "communication threads) or 1 (one for both)")
        split = _choice(env, "SPLIT_EXPERT_WGRAD", "0", ("0", "1"), "1 (down-projection expert wgrad in the next "
                        "combine-backward window) or 0 (with the rest of the expert wgrad)")
        fault = env.get(PREFIX + "FAULT")
        return cls(dtype=dtype, optimizer=optimizer, comm_timeout_s=timeout, device=device, backend=backend,
                   comm_nice=nice, paired_edges=paired == "1", comm_channels=int(channels),
                   split_expert_wgrad=split == "1",
                   fault=Fault.parse(fault) if fault else None,
                   heartbeat_dir=env.get(PREFIX + "HEARTBEAT_DIR") or None)


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...], hint: str) -> str:
    """`PREFIX + name` from `env` (`default` when unset); a value not in `choices` is a usage error that says
    what to use (`hint`)."""
    value = env.get(PREFIX + name, default)
    if value not in choices:
        raise UsageError(f"{PREFIX}{name}={value!r}: use {hint}")
    return value
