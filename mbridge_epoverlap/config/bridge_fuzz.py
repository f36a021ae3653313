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

Both Megatron-Bridge releases the validator knows are fuzzed the same way: the release is the one installed in
the interpreter (0.6.2 with Megatron-Core 0.19.2 from `scripts/setup_bridge_venv.sh`; main with Megatron-Core
main from `scripts/setup_bridge_main_venv.sh`), and the validator is asked for exactly that pair. The draws
cover the fields each Megatron-Core release has (the rank capacity factor, the TE op fuser, the HybridEP
knobs, NCCL EP's zero copy and, on 0.19, its static-shape switch; on main the wire dtypes, the grouped tensor
and drop-and-pad), and on Megatron-Bridge main two more steps of its `runtime_config_update`: native Energon
packing (`ConfigContainer._disable_native_energon_packing_moe_overlap`, before the comm-overlap set-up) and
the Megatron-FSDP v2 contract (`ConfigContainer._validate_and_apply_megatron_fsdp_configs`, after the model's
finalize), called on a stand-in container that holds only what they read. For every accepted case the EP
switches Bridge leaves on the model must be the ones the validator says will run (`switch_mismatch`).

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
from collections.abc import Callable
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
    "moe_expert_rank_capacity_factor", "moe_dispatch_fwd_dtype", "moe_use_grouped_tensor", "MFSDP V2",
)


@dataclass(frozen=True)
class Release:
    """The Megatron-Bridge and Megatron-Core the interpreter has, as the validator names them."""

    bridge: str  # "0.6.2" or "main"
    core: str  # e.g. "0.19.2", "0.20.0"

    @property
    def core_minor(self) -> tuple[int, int]:
        from mbridge_epoverlap.config.versions import core_rules

        return core_rules(self.core).minor

    @property
    def is_main(self) -> bool:
        return self.bridge == "main"


def installed_release() -> Release:
    """The release of the Megatron-Bridge and Megatron-Core imported here (a version above the newest release
    is main's)."""
    import megatron.bridge
    import megatron.core

    from mbridge_epoverlap.config.versions import bridge_release_of

    return Release(bridge_release_of(megatron.bridge.__version__), megatron.core.__version__)


@dataclass
class Case:
    """One random configuration and its environment."""

    model: dict[str, Any]
    comm: dict[str, Any]
    ddp_overlap_grad_reduce: bool
    gpu: str
    te_version: str
    packing_buffer_size: int | None = None  # Megatron-Bridge main: native Energon packing
    fsdp_v2: bool = False  # Megatron-Core main: Megatron-FSDP v2 (ddp.megatron_fsdp_version=2)


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
    switch_mismatch: int = 0  # accepted, but Bridge runs other EP switches than the validator says
    release: dict[str, str] = field(default_factory=dict)
    drawn: Counter = field(default_factory=Counter)  # how many cases set each newer field (coverage)
    by_rule: Counter = field(default_factory=Counter)  # validator errors on the configs Bridge rejected
    missed_by_rule: Counter = field(default_factory=Counter)  # Bridge's message head, for the missed ones
    false_by_rule: Counter = field(default_factory=Counter)
    other_by_message: Counter = field(default_factory=Counter)  # Bridge's message head, for the other rejections

    def count_rejection(self, rejection: str, errors: list[str]) -> str | None:
        """Count a case Megatron-Bridge rejected, against the validator's `errors`: "other" (a reason the validator
        does not model), "missed" (a modelled one the validator did not find), or None (both reject)."""
        self.rejected_by_bridge += 1
        self.by_rule.update(set(errors))
        if not is_modelled(rejection):
            self.other_rejected += 1
            self.other_by_message[rejection[:80]] += 1
            return "other"
        if not errors:
            self.missed += 1
            self.missed_by_rule[rejection[:80]] += 1
            return "missed"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"release": self.release, "tried": self.tried, "accepted": self.accepted,
                "rejected_by_bridge": self.rejected_by_bridge, "other_rejected": self.other_rejected,
                "missed": self.missed, "false": self.false, "false_on_object": self.false_on_object,
                "switch_mismatch": self.switch_mismatch, "drawn": dict(sorted(self.drawn.items())),
                "by_rule": dict(sorted(self.by_rule.items())),
                "missed_by_bridge_message": dict(self.missed_by_rule), "false_by_rule": dict(self.false_by_rule),
                "other_by_bridge_message": dict(self.other_by_message)}


def random_case(rng: random.Random, torch_dtype: Any, release: Release = Release("0.6.2", "0.19.2")) -> Case:
    """One configuration for `release` (Megatron-Bridge 0.6.2 on Megatron-Core 0.19.2 by default)."""
    from mbridge_epoverlap.config.fuzz import random_config

    model = random_config(rng, release.core_minor, torch_dtype)
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
    model.update(newer_fields(rng, release.core_minor, model))
    comm = {"overlap_moe_expert_parallel_comm": rng.choice(SWITCHES), "delay_wgrad_compute": rng.choice(SWITCHES),
            "overlap_grad_reduce": rng.choice((None, True, False))}
    case = Case(model, comm, rng.random() < 0.5, rng.choice(GPUS), rng.choice(TE_VERSIONS))
    if release.is_main:
        if rng.random() < 0.12:
            case.packing_buffer_size = rng.choice([4, 16])
        if rng.random() < 0.1:
            # Megatron-FSDP v2 asks for bf16 first of all; its other refusals are the ones the validator models.
            case.fsdp_v2 = True
            model.update(bf16=True, fp16=False, params_dtype=torch_dtype)
    return case


def newer_fields(rng: random.Random, release: tuple[int, int], model: dict[str, Any]) -> dict[str, Any]:
    """Random values of the flex-backend and grouped-GEMM fields Megatron-Core `release` has (none before 0.18)."""
    drawn: dict[str, Any] = {}
    ncclep = model["moe_token_dispatcher_type"] == "flex" and model.get("moe_flex_dispatcher_backend") == "ncclep"
    if release >= (0, 18):
        if rng.random() < 0.15:
            drawn["moe_expert_rank_capacity_factor"] = rng.choice([1.0, 1.5])
        if rng.random() < 0.25:
            drawn["use_transformer_engine_op_fuser"] = True
        if rng.random() < 0.1:
            drawn["moe_permute_fusion_into_hybridep"] = True
        if rng.random() < 0.1:
            drawn["moe_hybridep_num_sms"] = 64
    if release >= (0, 19) and rng.random() < (0.3 if ncclep else 0.05):
        drawn["moe_ncclep_zero_copy"] = True
    if release == (0, 19) and rng.random() < (0.3 if ncclep else 0.05):
        drawn["moe_ncclep_static_shape"] = True
    if release >= (0, 20):
        for name in ("moe_dispatch_fwd_dtype", "moe_combine_bwd_dtype"):
            if rng.random() < (0.25 if ncclep else 0.05):
                drawn[name] = "mxfp8"
        if rng.random() < 0.1:
            drawn["moe_use_grouped_tensor"] = True
            if rng.random() < 0.2:
                drawn["moe_grouped_gemm"] = False  # the grouped tensor holds grouped experts' weights only
        if ncclep and rng.random() < 0.15:  # drop-and-pad (capacity checks of other dispatchers are not modelled)
            drawn.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=rng.random() < 0.5)
        if ncclep and rng.random() < 0.3:
            drawn["moe_expert_rank_capacity_factor"] = 1.5
    return drawn


def bridge_verdict(case: Case) -> tuple[str | None, Any]:
    """(None, the finalized model) when Megatron-Bridge's config path accepts the case, else (its error, None)."""
    from megatron.bridge.models import GPTModelProvider

    return config_path_verdict(lambda: GPTModelProvider(**case.model), case)


def config_path_verdict(make_model: Callable[[], Any], case: Case) -> tuple[str | None, Any]:
    """Megatron-Bridge's config path on the model provider `make_model` builds (a fresh one, or a copy of a recipe's):
    the comm-overlap set-up with the case's switches, the flex and CUDA-graph checks and the model's `finalize()`
    (Core's `__post_init__`)."""
    from megatron.bridge.training.comm_overlap import CommOverlapConfig
    from megatron.bridge.training.flex_dispatcher_backend import validate_flex_dispatcher_backend
    from megatron.bridge.utils.cuda_graph import validate_cuda_graph_configuration
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from mbridge_epoverlap.config.bridge_cpu import set_te_version, target_gpu

    set_te_version(case.te_version)
    with target_gpu(case.gpu), _quiet():
        try:
            model = make_model()
            comm = CommOverlapConfig(tp_comm_overlap=False, **case.comm)
            if case.packing_buffer_size is not None:
                _disable_for_packing(model, comm, case.packing_buffer_size)
            comm.finalize()
            comm.data_parallel_size = 1
            ddp = DistributedDataParallelConfig(overlap_grad_reduce=case.ddp_overlap_grad_reduce,
                                                use_distributed_optimizer=True)
            comm.setup(model, OptimizerConfig(), ddp)
            validate_flex_dispatcher_backend(model)
            validate_cuda_graph_configuration(model)
            model.finalize()
            if case.fsdp_v2:
                _megatron_fsdp_v2(model)
        except (AssertionError, ValueError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}", None
    return None, model


def _disable_for_packing(model: Any, comm: Any, packing_buffer_size: int) -> None:
    """Megatron-Bridge main's packing step, on a stand-in container with the configs it reads."""
    from megatron.bridge.data.builders.energon import EnergonDatasetConfig
    from megatron.bridge.training.config import ConfigContainer

    dataset = object.__new__(EnergonDatasetConfig)  # only its type and packing_buffer_size are read
    dataset.packing_buffer_size = packing_buffer_size
    container = SimpleNamespace(dataset=dataset, model=model, comm_overlap=comm)
    ConfigContainer._disable_native_energon_packing_moe_overlap(container)  # type: ignore[arg-type]


def _megatron_fsdp_v2(model: Any) -> None:
    """Megatron-Bridge main's Megatron-FSDP check with ddp.megatron_fsdp_version=2, on a stand-in container whose
    other settings are the defaults a v2 run keeps (no checkpoint, no clipping, bf16 optimizer)."""
    from megatron.bridge.training.config import ConfigContainer
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, megatron_fsdp_version=2,
                                        data_parallel_sharding_strategy="optim_grads_params")
    methods = ("_validate_and_apply_megatron_fsdp_configs", "_validate_and_apply_megatron_fsdp_v1_configs",
               "_validate_and_apply_megatron_fsdp_v2_configs")
    stand_in = type("FsdpContainer", (), {name: getattr(ConfigContainer, name) for name in methods})()
    stand_in.__dict__.update(
        model=model, ddp=ddp, optimizer=OptimizerConfig(bf16=True, clip_grad=0.0),
        dist=SimpleNamespace(use_megatron_fsdp=True, use_tp_pp_dp_mapping=False),
        checkpoint=SimpleNamespace(save=None, load=None, pretrained_checkpoint=None),
        rng=SimpleNamespace(data_parallel_random_init=False))
    stand_in._validate_and_apply_megatron_fsdp_configs()


def _validator_inputs(case: Case, torch_version: str, release: Release) -> tuple[Any, Any, Any, Any]:
    """(environment, comm-overlap config, DDP config, dataset config) of the case, as the validator reads them."""
    from mbridge_epoverlap.config import CommOverlapConfig, Environment

    env = Environment.for_gpu(case.gpu, te_version=case.te_version, torch_version=torch_version,
                              mcore_version=release.core, bridge_version=release.bridge)
    ddp = SimpleNamespace(overlap_grad_reduce=case.ddp_overlap_grad_reduce, use_megatron_fsdp=case.fsdp_v2,
                          megatron_fsdp_version=2 if case.fsdp_v2 else 1)
    dataset = SimpleNamespace(packing_buffer_size=case.packing_buffer_size)
    return env, CommOverlapConfig(**case.comm), ddp, dataset


def validator_errors(case: Case, model: Any, torch_version: str,
                     release: Release = Release("0.6.2", "0.19.2")) -> list[str]:
    """The validator's errors for the case that Megatron-Bridge's config path enforces."""
    from mbridge_epoverlap.config.rules import all_rules
    from mbridge_epoverlap.config.versions import bridge_rules, core_rules
    from mbridge_epoverlap.config.violations import errors_of

    env, comm, ddp, dataset = _validator_inputs(case, torch_version, release)
    bridge, core = bridge_rules(env.bridge_version), core_rules(env.mcore_version)
    enforced = {r.id for r in all_rules() if r.enforced_by_bridge(bridge, core)}
    return [v.rule for v in errors_of(comm.validate(model, ddp, env, dataset=dataset)) if v.rule in enforced]


def validator_switches(case: Case, model: Any, torch_version: str, release: Release) -> tuple[bool, bool]:
    """(EP overlap, delayed wgrad) as the validator says the job runs them."""
    env, comm, _ddp, dataset = _validator_inputs(case, torch_version, release)
    return comm.effective_switches(model, env, dataset)


def is_modelled(rejection: str) -> bool:
    from mbridge_epoverlap.config.fuzz import is_overlap_rejection

    return is_overlap_rejection(rejection) or any(text in rejection for text in BRIDGE_REJECTIONS)


NEWER_FIELDS = ("moe_expert_rank_capacity_factor", "use_transformer_engine_op_fuser",
                "moe_permute_fusion_into_hybridep", "moe_hybridep_num_sms", "moe_ncclep_zero_copy",
                "moe_ncclep_static_shape", "moe_dispatch_fwd_dtype", "moe_combine_bwd_dtype", "moe_use_grouped_tensor",
                "moe_pad_expert_input_to_capacity")


def compare(samples: int, seed: int, examples: list[str] | None = None) -> Tally:
    """Draw `samples` cases, judge each with Megatron-Bridge and with the validator, count the disagreements."""
    import torch

    rng = random.Random(seed)
    release = installed_release()
    tally = Tally(release={"bridge": release.bridge, "core": release.core})
    torch_version = torch.__version__.split("+")[0]
    for index in range(samples):
        case = random_case(rng, torch.bfloat16, release)
        tally.tried += 1
        tally.drawn.update(name for name in NEWER_FIELDS if name in case.model)
        tally.drawn.update(name for name, on in (("dataset.packing_buffer_size", case.packing_buffer_size),
                                                 ("ddp.megatron_fsdp_version=2", case.fsdp_v2)) if on)
        rejection, built = bridge_verdict(case)
        errors = validator_errors(case, SimpleNamespace(**case.model), torch_version, release)
        if rejection is None:
            tally.accepted += 1
            if errors:
                tally.false += 1
                tally.false_by_rule.update(errors)
                _note(examples, f"false #{index}: validator {errors}; Bridge accepts {case}")
            on_object = validator_errors(case, built, torch_version, release)
            if on_object:
                tally.false_on_object += 1
                _note(examples, f"false on object #{index}: validator {on_object}; {case}")
            ours = validator_switches(case, SimpleNamespace(**case.model), torch_version, release)
            theirs = (bool(built.overlap_moe_expert_parallel_comm), bool(built.delay_wgrad_compute))
            if ours != theirs:
                tally.switch_mismatch += 1
                _note(examples, f"switches #{index}: validator {ours}, Bridge {theirs}; {case}")
            continue
        kind = tally.count_rejection(rejection, errors)
        if kind is not None:
            where = f"; {case}" if kind == "missed" else ""
            _note(examples, f"{kind} #{index}: Bridge says {rejection[:200]!r}{where}")
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
    return 0 if (tally.missed, tally.false, tally.false_on_object, tally.switch_mismatch) == (0, 0, 0, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
