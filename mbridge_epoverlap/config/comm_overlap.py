"""`CommOverlapConfig`: Megatron-Bridge's communication-overlap settings and their validator.

`validate` checks every rule of `mbridge_epoverlap.config.rules` and returns all violations at once;
`finalize` raises `ConfigValidationError` carrying every error. Nothing here imports torch or
Megatron-Core: a config can be checked for a cluster from a laptop.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from mbridge_epoverlap.config.environment import Environment
from mbridge_epoverlap.config.model import model_attr
from mbridge_epoverlap.config.rules import RuleContext, RunShape, evaluate
from mbridge_epoverlap.config.versions import bridge_rules, core_rules
from mbridge_epoverlap.config.violations import ConfigValidationError, Violation, errors_of
from mbridge_epoverlap.fields import get_field, set_field

logger = logging.getLogger(__name__)

EP_SWITCHES = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute")


@dataclass
class CommOverlapConfig:
    """Communication-overlap settings, with Megatron-Bridge's field names.

    Every field is optional. The two EP fields are independent switches; turning overlap off never
    turns delayed wgrad on or off by itself. As in Megatron-Bridge, an EP switch left None means off:
    Bridge's comm-overlap set-up starts from False, copies only the non-None values and writes the result
    onto the model, so a model-level `overlap_moe_expert_parallel_comm` / `delay_wgrad_compute` with the
    switch here unset is overwritten (the `model_switch_overwritten` rule warns). The other fields left
    None keep what the model or DDP config says.
    """

    tp_comm_overlap: bool = False
    tp_comm_overlap_cfg: Any = None
    tp_comm_bootstrap_backend: str | None = None
    overlap_p2p_comm: bool | None = None
    batch_p2p_comm: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    overlap_param_gather_with_optimizer_step: bool | None = None
    align_param_gather: bool | None = None
    bucket_size: int | None = None
    defer_embedding_wgrad_compute: bool | None = None
    wgrad_deferral_limit: int | None = None
    data_parallel_size: int | None = None
    overlap_moe_expert_parallel_comm: bool | None = None
    delay_wgrad_compute: bool | None = None

    @classmethod
    def created_by_job(cls) -> CommOverlapConfig:
        """The config a GPU job creates on a recipe that has none, to carry the user's or the A/B case's switches:
        Megatron-Bridge's `CommOverlapConfig(tp_comm_overlap=False)`, its defaults (NCCL bootstrap) otherwise."""
        return cls(tp_comm_overlap=False, tp_comm_bootstrap_backend="nccl")

    def effective_overlap(self, model_cfg: Any = None) -> bool:
        """EP overlap as the job will run it: this config's switch; unset is off, whatever `model_cfg` says."""
        return bool(self.overlap_moe_expert_parallel_comm)

    def effective_delay_wgrad(self, model_cfg: Any = None) -> bool:
        """Delayed wgrad as the job will run it: this config's switch; unset is off."""
        return bool(self.delay_wgrad_compute)

    def packing_cleared(self, model_cfg: Any, env: Environment | None, dataset: Any) -> frozenset[str]:
        """The EP switches Megatron-Bridge main switches off for native Energon packing (#5285): both, when
        either is requested here or on the model; none on other releases or without packing.

        Main clears them because overlap runs MCore's combined-1F1B schedule plan, which does not yet carry
        the VLM inputs and packed-sequence metadata (`ConfigContainer._disable_native_energon_packing_moe_overlap`,
        called by `runtime_config_update` before the comm-overlap set-up).
        """
        bridge = bridge_rules(env.bridge_version if env is not None else None)
        if not bridge.packing_clears_overlap or dataset is None:
            return frozenset()
        if get_field(dataset, "packing_buffer_size", None) is None:
            return frozenset()
        requested = [name for name in EP_SWITCHES if getattr(self, name) is True
                     or (model_cfg is not None and model_attr(model_cfg, name) is True)]
        return frozenset(EP_SWITCHES) if requested else frozenset()

    def effective_switches(self, model_cfg: Any = None, env: Environment | None = None,
                           dataset: Any = None) -> tuple[bool, bool]:
        """(EP overlap, delayed wgrad) as the job runs them on `env`'s Megatron-Bridge, packing included."""
        if self.packing_cleared(model_cfg, env, dataset):
            return False, False
        return self.effective_overlap(model_cfg), self.effective_delay_wgrad(model_cfg)

    def grad_reduce_for_te_check(self, ddp_config: Any) -> bool:
        """What Megatron-Bridge's delayed-wgrad TE check reads: the DDP value or this config's.

        Bridge checks `ddp.overlap_grad_reduce or comm_overlap.overlap_grad_reduce` before its own set-up
        writes the comm value onto DDP, so either one on asks for TE >= 2.7, even when the other is False.
        """
        ddp_value = bool(get_field(ddp_config, "overlap_grad_reduce", False)) if ddp_config is not None else False
        return ddp_value or bool(self.overlap_grad_reduce)

    def unset_switches(self) -> frozenset[str]:
        """The EP switches left None here (Megatron-Bridge writes False onto the model for them)."""
        return frozenset(name for name in EP_SWITCHES if getattr(self, name) is None)

    def effective_overlap_grad_reduce(self, ddp_config: Any) -> bool:
        if self.overlap_grad_reduce is not None:
            return bool(self.overlap_grad_reduce)
        if ddp_config is None:
            return False
        return bool(get_field(ddp_config, "overlap_grad_reduce", False))

    def validate(self, model_cfg: Any, ddp_config: Any = None, env: Environment | None = None,
                 run: RunShape | None = None, dataset: Any = None) -> list[Violation]:
        """Every violated rule for this overlap config on `model_cfg`, errors and warnings.

        Args:
            model_cfg: any object with Megatron-Core `TransformerConfig` attribute names (a real
                TransformerConfig, a Megatron-Bridge model provider, a namespace, a dict); absent
                attributes take Megatron-Core's defaults.
            ddp_config: the DDP config (reads `overlap_grad_reduce`), or None.
            env: versions and GPU to check for; None means this machine (`Environment.detect()`).
            run: GPU count and batch shape of a whole run; the layout rules apply only with it.
            dataset: the dataset config (reads `packing_buffer_size`), or None.
        """
        env = env if env is not None else Environment.detect()
        cleared = self.packing_cleared(model_cfg, env, dataset)
        overlap, delay = self.effective_switches(model_cfg, env, dataset)
        ctx = RuleContext(
            model=model_cfg,
            overlap=overlap,
            delay_wgrad=delay,
            overlap_grad_reduce=self.grad_reduce_for_te_check(ddp_config),
            env=env,
            core=core_rules(env.mcore_version),
            run=run,
            bridge=bridge_rules(env.bridge_version),
            # Switches the packing step cleared are False, not unset, by the time Bridge copies them to the model.
            unset_switches=self.unset_switches() - cleared,
            ddp=ddp_config,
            dataset=dataset,
            packing_cleared=cleared,
        )
        return evaluate(ctx)

    def finalize(self, model_cfg: Any, ddp_config: Any = None, env: Environment | None = None,
                 dataset: Any = None) -> list[Violation]:
        """Validate, raise `ConfigValidationError` with every error, then write the EP switches to the model.

        Returns the warnings (also logged). The model gets `overlap_moe_expert_parallel_comm` and
        `delay_wgrad_compute` as they will run (False where unset here, or cleared for packing on Megatron-Bridge
        main), as Megatron-Bridge's set-up does.
        """
        env = env if env is not None else Environment.detect()
        violations = self.validate(model_cfg, ddp_config, env, dataset=dataset)
        errors = errors_of(violations)
        if errors:
            raise ConfigValidationError(errors)
        warnings_found = [v for v in violations if v.severity == "warning"]
        for v in warnings_found:
            logger.warning("[%s] %s (fix: %s)", v.rule, v.message, v.fix)
        overlap, delay = self.effective_switches(model_cfg, env, dataset)
        for name, value in (("overlap_moe_expert_parallel_comm", overlap), ("delay_wgrad_compute", delay)):
            set_field(model_cfg, name, value)
        return warnings_found

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
