"""The run config a recipe returns: model, comm_overlap, train, ddp, launch environment.

Its top-level keys are the prefixes of dotted overrides (`model.bf16=true`,
`comm_overlap.delay_wgrad_compute=false`, `train.global_batch_size=512`, `env_vars.NCCL_DEBUG=INFO`),
as in Megatron-Bridge's ConfigContainer.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mbridge_epoverlap.config.comm_overlap import CommOverlapConfig
from mbridge_epoverlap.config.environment import Environment
from mbridge_epoverlap.config.fixes import agree_on_ep
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.config.rules import RunShape
from mbridge_epoverlap.config.violations import Violation


@dataclass
class TrainConfig:
    """Batch shape and iteration count."""

    global_batch_size: int = 8
    micro_batch_size: int = 1
    train_iters: int = 10
    seed: int = 1234
    lr: float = 1.0e-4


@dataclass
class DDPConfig:
    """The data-parallel settings the overlap rules read."""

    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = True
    bucket_size: int | None = None
    grad_reduce_in_fp32: bool = True
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    fsdp_double_buffer: bool = False
    megatron_fsdp_version: int = 1  # Megatron-Core 0.20 (main): 2 selects Megatron-FSDP v2


@dataclass
class DatasetConfig:
    """The dataset settings the overlap rules read.

    `packing_buffer_size` is the native sequence packing of an Energon (multimodal) dataset: set, the job's
    dataset is an Energon dataset that packs, which Megatron-Bridge main runs with EP overlap off.
    """

    packing_buffer_size: int | None = None


@dataclass
class RunConfig:
    """Everything one run needs; recipes return it, overrides edit it, the harness launches it.

    Attributes:
        recipe: recipe name (e.g. "qwen3_30b_a3b").
        task: "pretrain" or "sft".
        num_gpus: total GPUs (or CPU processes for `-g cpu`).
        gpus_per_node: GPUs per node.
        model, comm_overlap, train, ddp, dataset: the sections overrides address.
        env_vars: launch environment (set before the processes start; setting them from Python at run
            time is too late for CUDA_DEVICE_MAX_CONNECTIONS).
    """

    recipe: str = "custom"
    task: str = "pretrain"
    num_gpus: int = 1
    gpus_per_node: int = 8
    model: MoEModelConfig = field(default_factory=MoEModelConfig)
    comm_overlap: CommOverlapConfig = field(default_factory=CommOverlapConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    env_vars: dict[str, str] = field(default_factory=dict)

    def validate(self, env: Environment | None = None) -> list[Violation]:
        """Every EP-overlap and layout violation of this run, errors and warnings."""
        run = RunShape(self.num_gpus, self.train.global_batch_size, self.train.micro_batch_size)
        violations = self.comm_overlap.validate(self.model, self.ddp, env, run=run, dataset=self.dataset)
        return agree_on_ep(violations, self.model, self.num_gpus)

    def effective_switches(self, env: Environment | None = None) -> tuple[bool, bool]:
        """(EP overlap, delayed wgrad) as the job runs them on `env`'s Megatron-Bridge (see
        `CommOverlapConfig.effective_switches`)."""
        return self.comm_overlap.effective_switches(self.model, env, self.dataset)

    def copy(self) -> RunConfig:
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-ready) with `model.*`, `comm_overlap.*`, ... keys."""
        data = dataclasses.asdict(self)
        data["comm_overlap"]["tp_comm_overlap_cfg"] = _plain(self.comm_overlap.tp_comm_overlap_cfg)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Inverse of `to_dict` (unknown keys are an error, via the override machinery)."""
        from mbridge_epoverlap.config.overrides import apply_mapping

        cfg = cls()
        apply_mapping(cfg, data)
        return cfg

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return value
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return str(value)
