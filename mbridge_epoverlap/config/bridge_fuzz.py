"""Random EP-overlap configurations through Megatron-Bridge's real config code and through the validator.

The differential test against Megatron-Bridge (`tests/unit_tests/training/test_bridge_differential.py`,
a sample) and the `bridge_fuzz` benchmark (the full run) share this. Each case draws a model config (as
`config.fuzz.random_config` does for Megatron-Core, plus flex backends, activation offloading, leftover
graph modules and model-level switches), the `comm_overlap.*` switches (unset, on or off), the DDP and
comm `overlap_grad_reduce`, a GPU of the catalog and a Transformer Engine version. Megatron-Bridge judges
it the way `runtime_config_update` does on a CPU: `CommOverlapConfig.finalize()` + `setup()`,
`validate_flex_dispatcher_backend`, `validate_cuda_graph_configuration` and the model's `finalize()`
(Megatron-Core's `TransformerConfig.__post_init__`), under the GPU's mock (`bridge_cpu`). The validator
judges the same case for the same environment; only the rules Bridge's config path enforces
(`Rule.enforced_by_bridge`) are compared: the checks of model build, model wrap and the perf script
reject configurations this path accepts, by design.

Run it in the Python 3.12 environment that has Megatron-Bridge (`python -m mbridge_epoverlap.config.bridge_fuzz
--samples 300`); it prints the counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

GPUS = ("h100", "a100", "b200", "gb200", "l40s")
TE_VERSIONS = ("2.2.0", "2.6.0", "2.9.0", "2.11.0", "2.12.0", "2.18.0")
SWITCHES = (None, None, True, True, True, False)
BACKENDS = ("deepep", "hybridep", "ncclep", None)
OFFLOADS = (["expert_fc1"], ["moe_act"], ["expert_fc1", "moe_act"])
# Texts of the rejections the validator models (Megatron-Bridge's asserts and Megatron-Core's overlap checks).
BRIDGE_REJECTIONS = (
    "TE version >= 2.7.0", "CUDA graph with delay_wgrad_compute", "is supported for", "Megatron Bridge supports",
    "ncclep", "TE version >= 2.3.0", "overlap_dispatch_backward_with_experts_wgrad",
)


@dataclass
class Case:
    """One random configuration and its environment."""

    model: dict[str, Any]
    comm: dict[str, Any]
    ddp_overlap_grad_reduce: bool
    gpu: str
    te_version: str


@dataclass
class Tally:
    """Counts of one run: configs tried, Bridge's verdicts, and the disagreements by rule."""

    tried: int = 0
    accepted: int = 0
    rejected_by_bridge: int = 0
    other_rejected: int = 0  # Bridge rejected for a reason the validator does not model (not compared)
    missed: int = 0  # Bridge rejected for a modelled reason; the validator found no Bridge-enforced error
    false: int = 0  # the validator found a Bridge-enforced error; Bridge accepted
    false_on_object: int = 0  # the validator, reading the accepted model back, found such an error
    by_rule: Counter = field(default_factory=Counter)  # validator errors on the configs Bridge rejected
    missed_by_rule: Counter = field(default_factory=Counter)  # Bridge's message head, for the missed ones
    false_by_rule: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"tried": self.tried, "accepted": self.accepted, "rejected_by_bridge": self.rejected_by_bridge,
                "other_rejected": self.other_rejected, "missed": self.missed, "false": self.false,
                "false_on_object": self.false_on_object, "by_rule": dict(sorted(self.by_rule.items())),
                "missed_by_bridge_message": dict(self.missed_by_rule), "false_by_rule": dict(self.false_by_rule)}


def random_case(rng: random.Random, torch_dtype: Any) -> Case:
    """One configuration for Megatron-Core 0.19 under Megatron-Bridge 0.6."""
    from mbridge_epoverlap.config.fuzz import random_config

    model = random_config(rng, (0, 19), torch_dtype)
    if rng.random() < 0.5:  # half the cases start from a layout EP overlap accepts, so both verdicts are common
        model.update(moe_token_dispatcher_type=rng.choice(["alltoall", "flex"]), bf16=True, fp16=False,
                     recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                     recompute_modules=None, pipeline_model_parallel_size=1,
                     virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=rng.choice([2, 4]),
                     mtp_num_layers=None, moe_shared_expert_overlap=False)
    model["overlap_moe_expert_parallel_comm"] = rng.random() < 0.3  # model-level: Bridge overwrites them
    model["delay_wgrad_compute"] = rng.random() < 0.2
    if model["moe_token_dispatcher_type"] == "flex":
        model["moe_flex_dispatcher_backend"] = rng.choice(BACKENDS)
    elif rng.random() < 0.05:
        model["moe_flex_dispatcher_backend"] = "ncclep"
    if rng.random() < 0.15:
        model["fine_grained_activation_offloading"] = True
        model["offload_modules"] = list(rng.choice(OFFLOADS))
    if rng.random() < 0.08:
        model["overlap_dispatch_backward_with_experts_wgrad"] = True
    if model["cuda_graph_impl"] == "none" and rng.random() < 0.2:
        model["cuda_graph_modules"] = list(rng.choice([["attn"], ["moe_router"]]))  # leftover modules
    model["use_te_rng_tracker"] = model["cuda_graph_impl"] != "none"
    comm = {"overlap_moe_expert_parallel_comm": rng.choice(SWITCHES), "delay_wgrad_compute": rng.choice(SWITCHES),
            "overlap_grad_reduce": rng.choice((None, True, False))}
    return Case(model, comm, rng.random() < 0.5, rng.choice(GPUS), rng.choice(TE_VERSIONS))


def bridge_verdict(case: Case) -> tuple[str | None, Any]:
    """(None, the finalized model) when Megatron-Bridge's config path accepts the case, else (its error, None)."""
    from megatron.bridge.models import GPTModelProvider
    from megatron.bridge.training.comm_overlap import CommOverlapConfig
    from megatron.bridge.training.flex_dispatcher_backend import validate_flex_dispatcher_backend
    from megatron.bridge.utils.cuda_graph import validate_cuda_graph_configuration
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from mbridge_epoverlap.config.bridge_cpu import set_te_version, target_gpu

    set_te_version(case.te_version)
    with target_gpu(case.gpu), _quiet():
        try:
            model = GPTModelProvider(**case.model)
            comm = CommOverlapConfig(tp_comm_overlap=False, **case.comm)
            comm.finalize()
            comm.data_parallel_size = 1
            ddp = DistributedDataParallelConfig(overlap_grad_reduce=case.ddp_overlap_grad_reduce,
                                                use_distributed_optimizer=True)
            comm.setup(model, OptimizerConfig(), ddp)
            validate_flex_dispatcher_backend(model)
            validate_cuda_graph_configuration(model)
            model.finalize()
        except (AssertionError, ValueError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}", None
    return None, model


def validator_errors(case: Case, model: Any, torch_version: str) -> list[str]:
    """The validator's errors for the case that Megatron-Bridge's config path enforces."""
    from mbridge_epoverlap.config import CommOverlapConfig, Environment
    from mbridge_epoverlap.config.rules import all_rules
    from mbridge_epoverlap.config.versions import bridge_rules, core_rules
    from mbridge_epoverlap.config.violations import errors_of

    env = Environment.for_gpu(case.gpu, te_version=case.te_version, torch_version=torch_version,
                              mcore_version="0.19.2", bridge_version="0.6.2")
    bridge, core = bridge_rules(env.bridge_version), core_rules(env.mcore_version)
    enforced = {r.id for r in all_rules() if r.enforced_by_bridge(bridge, core)}
    comm = CommOverlapConfig(**case.comm)
    ddp = SimpleNamespace(overlap_grad_reduce=case.ddp_overlap_grad_reduce)
    return [v.rule for v in errors_of(comm.validate(model, ddp, env)) if v.rule in enforced]


def is_modelled(rejection: str) -> bool:
    from mbridge_epoverlap.config.fuzz import is_overlap_rejection

    return is_overlap_rejection(rejection) or any(text in rejection for text in BRIDGE_REJECTIONS)


def compare(samples: int, seed: int, examples: list[str] | None = None) -> Tally:
    """Draw `samples` cases, judge each with Megatron-Bridge and with the validator, count the disagreements."""
    import torch

    rng = random.Random(seed)
    tally = Tally()
    torch_version = torch.__version__.split("+")[0]
    for index in range(samples):
        case = random_case(rng, torch.bfloat16)
        tally.tried += 1
        rejection, built = bridge_verdict(case)
        errors = validator_errors(case, SimpleNamespace(**case.model), torch_version)
        if rejection is None:
            tally.accepted += 1
            if errors:
                tally.false += 1
                tally.false_by_rule.update(errors)
                _note(examples, f"false #{index}: validator {errors}; Bridge accepts {case}")
            on_object = validator_errors(case, built, torch_version)
            if on_object:
                tally.false_on_object += 1
                _note(examples, f"false on object #{index}: validator {on_object}; {case}")
            continue
        tally.rejected_by_bridge += 1
        tally.by_rule.update(set(errors))
        if not is_modelled(rejection):
            tally.other_rejected += 1
            _note(examples, f"other #{index}: Bridge says {rejection[:200]!r}")
        elif not errors:
            tally.missed += 1
            tally.missed_by_rule[rejection[:80]] += 1
            _note(examples, f"missed #{index}: Bridge says {rejection[:200]!r}; {case}")
    return tally


class _quiet:
    """Mute the libraries' warnings and logging for one case (they log every fallback and deprecation)."""

    def __enter__(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._previous = logging.root.manager.disable
        logging.disable(logging.WARNING)

    def __exit__(self, *exc: Any) -> None:
        logging.disable(self._previous)
        self._warnings.__exit__(*exc)


def _note(examples: list[str] | None, text: str) -> None:
    if examples is not None and len(examples) < 30:
        examples.append(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.config.bridge_fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--examples", action="store_true", help="print disagreements and other rejections")
    args = parser.parse_args(argv)
    import contextlib

    from mbridge_epoverlap.config.bridge_cpu import install_fake_te

    install_fake_te()
    examples: list[str] = []
    with contextlib.redirect_stdout(sys.stderr):  # the libraries log to stdout; it carries the JSON only
        tally = compare(args.samples, args.seed, examples)
    result = tally.to_dict()
    if args.examples:
        result["examples"] = examples
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if (tally.missed, tally.false, tally.false_on_object) == (0, 0, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
