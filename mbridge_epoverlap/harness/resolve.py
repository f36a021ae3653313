"""From command-line flags to one run config: recipe -> dotted overrides -> flags -> (-g cpu) shrink.

For a GPU target the recipe is the project's recipe with the values of the Megatron-Bridge recipe the job
builds on top (`upstream_recipe`), so what is validated is the job that will run; `-g cpu` runs the
project's recipe itself. Validation and the A/B cases come after this (see `cases.py`); nothing here launches anything.
A flag and a dotted override that set the same setting to different values are a usage error, so
the order between them never decides silently.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.cpu_precision import CpuPrecision, choose_cpu_precision
from mbridge_epoverlap.config.environment import Environment
from mbridge_epoverlap.config.overrides import DELAY_FIELD, OVERLAP_FIELD, apply_overrides, parse_override
from mbridge_epoverlap.config.release_fields import check_release_fields
from mbridge_epoverlap.config.versions import bridge_rules, core_rules
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.fields import get_path
from mbridge_epoverlap.gpus import GPU_FACTS
from mbridge_epoverlap.harness.flags import DEFAULT_CPU_PROCS, DEFAULT_MAX_STEPS, MODEL_FLAGS, given
from mbridge_epoverlap.harness.upstream_recipe import UpstreamRecipe, upstream_recipe

# Megatron-Bridge mixed-precision recipe names per -c value (GPU jobs).
MIXED_PRECISION = {
    "bf16": "bf16_mixed",
    "fp16": "fp16_mixed",
    "fp8_cs": "bf16_with_fp8_current_scaling_mixed",
    "fp8_mx": "bf16_with_mxfp8_mixed",
    "fp8_sc": "bf16_with_fp8_subchannel_scaling_mixed",
    "nvfp4": "bf16_with_nvfp4_mixed",
}
LOW_PRECISION = ("fp8_cs", "fp8_mx", "fp8_sc", "nvfp4")
# Flags that write settings outside MODEL_FLAGS, by the dotted key they write.
FLAG_OF_KEY = {
    "comm_overlap.overlap_moe_expert_parallel_comm": "--moe_a2a_overlap",
    "comm_overlap.delay_wgrad_compute": "--delay_wgrad_compute",
    "model.bf16": "-c/--compute_dtype",
    "model.fp16": "-c/--compute_dtype",
    "model.moe_token_dispatcher_type": "--moe_flex_dispatcher_backend",
    "model.moe_flex_dispatcher_backend": "--moe_flex_dispatcher_backend",
    "model.moe_shared_expert_overlap": "--moe_flex_dispatcher_backend",
    "num_gpus": "-ng/--num_gpus",
    "gpus_per_node": "-gn/--gpus_per_node",
    "train.global_batch_size": "-gb/--global_batch_size",
    "train.micro_batch_size": "-mb/--micro_batch_size",
    "train.train_iters": "-ms/--max_steps",
    "model.use_te_rng_tracker": "--cuda_graph_impl",
    "ddp.use_megatron_fsdp": "--use_megatron_fsdp",
    "ddp.data_parallel_sharding_strategy": "--use_megatron_fsdp",
    "model.gradient_accumulation_fusion": "--use_megatron_fsdp",
}
# Keys -g cpu keeps from the user after shrinking: the batch shape is the CPU run's own choice.
CPU_KEPT_KEYS = ("train.global_batch_size", "train.micro_batch_size", "model.seq_length")


@dataclass
class Target:
    """Where the run goes: the GPU family (or cpu) and the environment the validator checks for."""

    gpu: str
    env: Environment

    @property
    def is_cpu(self) -> bool:
        return self.gpu == "cpu"


@dataclass
class Resolved:
    """The resolved base config (before A/B case switches) and what the launch needs besides it.

    Attributes:
        cfg: recipe + overrides + flags (+ CPU shrink); not finalized.
        target: GPU family and validation environment.
        max_steps: iterations per run.
        mixed_precision: Megatron-Bridge precision recipe for GPU jobs (None: fp32).
        tokenizer_type: tokenizer of GPU jobs, or None for the recipe's.
        explicit: dotted keys the user set (overrides and flags).
        notes: things the user should know (printed on stderr).
        cpu_precision: -g cpu: the dtype the runtime computes in and why (None for GPU targets).
        flag_keys: dotted keys set by flags (not by dotted overrides); the launch environment reads them.
        recipe: GPU targets: the recipe the job builds, as the run config sees it before any override or
            flag (the Megatron-Bridge recipe's values where they are known, see `upstream`); None for cpu.
        upstream: GPU targets: what the job builds (`harness.upstream_recipe.UpstreamRecipe`); None for cpu.
        stand_ins: -g cpu: what the CPU model runs in place of the layer kinds the reference runtime lacks (also in
            `notes`; the results record them).
    """

    cfg: RunConfig
    target: Target
    max_steps: int
    mixed_precision: str | None
    tokenizer_type: str | None
    explicit: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    cpu_precision: CpuPrecision | None = None
    flag_keys: set[str] = field(default_factory=set)
    recipe: RunConfig | None = None
    upstream: UpstreamRecipe | None = None
    stand_ins: list[str] = field(default_factory=list)


def pick_recipe(family: str | None, recipe: str | None, notes: list[str] | None = None) -> str:
    """The recipe to load from -m/-mr.

    As Megatron-Bridge's run_script.py, the workload is found by -mr alone, across every family: a -m that names
    another family than the workload's is said in `notes`, not an error. An unknown family (without -mr) is a
    usage error naming the families; an unknown workload name is left to the loader, which names the known ones.
    """
    from mbridge_epoverlap.recipes import DEFAULT_RECIPE, FAMILIES
    from mbridge_epoverlap.recipes.loader import family_of

    if family is not None and family not in FAMILIES:
        raise UsageError(f"unknown model family {family!r} (-m); known: {', '.join(sorted(FAMILIES))}"
                         + (f"; or leave -m out: -mr {recipe} is found in any family" if recipe else ""))
    if recipe is None:
        return FAMILIES[family][0] if family else DEFAULT_RECIPE
    owner = family_of(recipe)
    if family is not None and owner is not None and owner != family and notes is not None:
        notes.append(f"-m {family}: {recipe} is in Megatron-Bridge's {owner} recipes; found there by -mr, as "
                     "Megatron-Bridge's run_script.py finds it")
    return recipe


def target_environment(args: argparse.Namespace) -> Target:
    """`Environment.detect()` for cpu (with any versions given), `Environment.for_gpu` for a GPU family.

    A release the validator does not know is a usage error; Megatron-Bridge main is checked with Megatron-Core
    main (0.20) unless --mcore_version says otherwise (main is built against it).
    """
    from mbridge_epoverlap.config.environment import parse_bridge_version
    from mbridge_epoverlap.config.versions import CORE_OF_BRIDGE_MAIN, check_known_releases

    bridge = getattr(args, "bridge_version", None)
    check_known_releases(args.mcore_version, bridge, mcore_flag="--mcore_version", bridge_flag="--bridge_version")
    mcore = args.mcore_version
    if mcore is None and parse_bridge_version(bridge, "--bridge_version") == "main":
        mcore = CORE_OF_BRIDGE_MAIN
    versions = {"te_version": args.te_version, "torch_version": args.torch_version,
                "mcore_version": mcore, "bridge_version": bridge}
    if args.gpu == "cpu":
        return Target("cpu", Environment.detect().with_versions(**versions))
    return Target(args.gpu, Environment.for_gpu(args.gpu, **versions))


def resolve(args: argparse.Namespace) -> Resolved:
    """Build the base run config from parsed flags.

    Raises:
        UsageError: unknown recipe/family, malformed or unknown override, conflicting flag and
            override, a precision the target cannot run, an impossible CPU layout.
    """
    from mbridge_epoverlap.recipes.loader import load_recipe

    target = target_environment(args)
    notes: list[str] = []
    name = pick_recipe(args.model_family_name, args.model_recipe_name, notes)
    cfg = load_recipe(name, args.task)
    upstream = None
    if not target.is_cpu:
        # The job builds Megatron-Bridge's recipe for the final GPU count and precision: find it from a probe
        # with every override and flag applied, then start this config from that recipe's values.
        probe = apply_overrides(cfg.copy(), args.overrides)
        _apply_flags(probe, args, target, {parse_override(item)[0] for item in args.overrides})
        upstream = upstream_recipe(args, probe)
        upstream.apply(cfg)
        notes += upstream.notes
    recipe = cfg.copy() if upstream is not None else None
    apply_overrides(cfg, args.overrides)
    override_keys = [parse_override(item)[0] for item in args.overrides]
    before = {key: get_path(cfg, key) for key in override_keys}
    explicit = set(override_keys)

    flag_keys = _apply_flags(cfg, args, target, explicit)
    explicit |= flag_keys
    conflicts = [f"{key}: the override says {before[key]!r}, {_flag_of(key)} says {get_path(cfg, key)!r}"
                 for key in override_keys if get_path(cfg, key) != before[key]]
    if conflicts:
        raise UsageError("a flag and a dotted override set the same setting differently (" + "; ".join(conflicts)
                         + "); give each setting once")
    if not target.is_cpu:  # the CPU runtime has no Megatron fields; a GPU job's releases must have the ones set
        check_release_fields(cfg, bridge_rules(target.env.bridge_version), core_rules(target.env.mcore_version),
                             keys=explicit)

    max_steps = args.max_steps if given(args, "max_steps") else (
        cfg.train.train_iters if "train.train_iters" in explicit else DEFAULT_MAX_STEPS)
    cfg.train.train_iters = max_steps
    precision = None
    stand_ins: list[str] = []
    if target.is_cpu:
        stand_ins = _stand_ins(cfg) + _drop_recipe_recompute(cfg, explicit)
        notes += [f"-g cpu: {line}" for line in stand_ins]
        cfg = _shrink(cfg, args, explicit, notes)
        precision = _cpu_precision(cfg, args, explicit)
        notes.append(f"-g cpu computes in {precision.reason}")
    mixed = _mixed_precision(cfg, args)
    return Resolved(cfg, target, max_steps, mixed, args.tokenizer_type, explicit, notes, precision, flag_keys,
                    recipe, upstream, stand_ins)


def _cpu_precision(cfg: RunConfig, args: argparse.Namespace, explicit: set[str]) -> CpuPrecision:
    """Choose the CPU runtime's dtype and hand it to the ranks through `MBRIDGE_EPOVERLAP_DTYPE`.

    Explicit means `-c`, a dotted `model.bf16`/`model.fp16` override, or the variable itself set with
    `env_vars.MBRIDGE_EPOVERLAP_DTYPE=...`; otherwise the CPU's flags decide (see `config.cpu_precision`).
    """
    from mbridge_epoverlap.runtime.options import PREFIX

    variable = PREFIX + "DTYPE"
    low = bool(cfg.model.bf16 or cfg.model.fp16)
    requested = None
    if given(args, "compute_dtype"):
        requested = args.compute_dtype
    elif {"model.bf16", "model.fp16"} & explicit:
        requested = "bf16" if cfg.model.bf16 else "fp16" if cfg.model.fp16 else "fp32"
    if cfg.env_vars.get(variable):
        requested = str(cfg.env_vars[variable])
        if requested not in ("fp32", "bf16"):
            raise UsageError(f"env_vars.{variable}={requested!r}: use fp32 or bf16 (or -c instead)")
    precision = choose_cpu_precision(low, requested=requested)
    cfg.env_vars[variable] = precision.dtype
    return precision


def _flag_of(key: str) -> str:
    """The flag that writes a dotted key (for messages)."""
    for dest, name in MODEL_FLAGS:
        if key == f"model.{name}":
            return f"--{dest}"
    return FLAG_OF_KEY.get(key, "a flag")


def _apply_flags(cfg: RunConfig, args: argparse.Namespace, target: Target, overridden: set[str]) -> set[str]:
    """Apply every given flag (and the target's defaults for keys nobody set); return the keys flags set."""
    from mbridge_epoverlap.config.overrides import set_moe_a2a_overlap_overrides

    keys: set[str] = set()
    m = cfg.model
    if given(args, "compute_dtype"):
        _apply_compute_dtype(cfg, args.compute_dtype, target)
        keys |= {"model.bf16", "model.fp16"}
    if given(args, "num_gpus"):
        cfg.num_gpus = args.num_gpus
        keys.add("num_gpus")
    elif target.is_cpu and "num_gpus" not in overridden:
        cfg.num_gpus = DEFAULT_CPU_PROCS
    if given(args, "gpus_per_node"):
        cfg.gpus_per_node = args.gpus_per_node
        keys.add("gpus_per_node")
    elif target.gpu in GPU_FACTS and GPU_FACTS[target.gpu].gpus_per_node != 8 and "gpus_per_node" not in overridden:
        cfg.gpus_per_node = GPU_FACTS[target.gpu].gpus_per_node  # GB200/GB300/VR200 trays: 4; R100: 1
    for dest, key in (("global_batch_size", "train.global_batch_size"), ("micro_batch_size", "train.micro_batch_size"),
                      ("max_steps", "train.train_iters")):
        if given(args, dest):
            setattr(cfg.train, key.split(".")[1], getattr(args, dest))
            keys.add(key)
    for dest, name in MODEL_FLAGS:
        if given(args, dest):
            setattr(m, name, getattr(args, dest))
            keys.add(f"model.{name}")
    keys |= _apply_cuda_graph_flags(cfg, given(args, "cuda_graph_impl"), overridden)
    if getattr(args, "use_megatron_fsdp", None):
        keys |= _apply_megatron_fsdp(cfg)
    if given(args, "moe_flex_dispatcher_backend"):
        _apply_flex(cfg, args.moe_flex_dispatcher_backend, target)
        keys |= {"model.moe_token_dispatcher_type", "model.moe_flex_dispatcher_backend"}
    overlap = args.moe_a2a_overlap if given(args, "moe_a2a_overlap") else None
    delay = args.delay_wgrad_compute if given(args, "delay_wgrad_compute") else None
    set_moe_a2a_overlap_overrides(cfg, overlap, delay)
    if overlap is not None:
        keys.add(f"comm_overlap.{OVERLAP_FIELD}")
    if delay is not None:
        keys.add(f"comm_overlap.{DELAY_FIELD}")
    return keys


def _apply_cuda_graph_flags(cfg: RunConfig, impl_given: bool, overridden: set[str]) -> set[str]:
    """What Megatron-Bridge's run_script.py does with graphs: `--cuda_graph_impl` other than none switches the
    TE RNG tracker on (every graph needs it); a config left without graphs has the tracker off and no graph
    modules (settings a dotted override gave are kept). Returns the keys set."""
    m = cfg.model
    if impl_given and m.cuda_graph_impl != "none":
        m.use_te_rng_tracker = True
        return {"model.use_te_rng_tracker"}
    if m.cuda_graph_impl != "none":
        return set()
    if "model.use_te_rng_tracker" not in overridden:
        m.use_te_rng_tracker = False
    if "model.cuda_graph_scope" not in overridden:
        m.cuda_graph_scope = []
    return {"model.use_te_rng_tracker"} if impl_given and "model.use_te_rng_tracker" not in overridden else set()


def _apply_megatron_fsdp(cfg: RunConfig) -> set[str]:
    """`--use_megatron_fsdp true` as run_script.py sets it (the settings the validator reads)."""
    cfg.ddp.use_megatron_fsdp = True
    cfg.ddp.data_parallel_sharding_strategy = "optim_grads_params"
    cfg.model.gradient_accumulation_fusion = True
    return {"ddp.use_megatron_fsdp", "ddp.data_parallel_sharding_strategy", "model.gradient_accumulation_fusion"}


def _apply_compute_dtype(cfg: RunConfig, dtype: str, target: Target) -> None:
    m = cfg.model
    if dtype == "fp32":
        if not target.is_cpu:
            raise UsageError(f"-c fp32 is for -g cpu only; Megatron-Bridge GPU runs use bf16 or fp16 "
                             f"(EP overlap needs one of them) — use -c bf16 with -g {target.gpu}")
        m.bf16 = m.fp16 = False
    elif dtype in LOW_PRECISION:
        if target.is_cpu:
            raise UsageError(f"-c {dtype} needs Transformer Engine on a GPU; the CPU reference runtime runs "
                             "bf16, fp16 or fp32 — use -c bf16 with -g cpu")
        # FP8/FP4 recipes keep bf16 parameters; Transformer Engine quantizes the GEMMs.
        m.bf16, m.fp16 = True, False
    else:
        m.bf16, m.fp16 = dtype == "bf16", dtype == "fp16"


def _apply_flex(cfg: RunConfig, backend: str | None, target: Target) -> None:
    from mbridge_epoverlap.config.flex import apply_flex_dispatcher_backend

    m = cfg.model
    if backend is None:
        if m.moe_token_dispatcher_type == "flex":
            m.moe_token_dispatcher_type = "alltoall"
        m.moe_flex_dispatcher_backend = None
        return
    try:
        apply_flex_dispatcher_backend(m, backend, env=target.env, strict=True)
    except UsageError:
        # Asked for explicitly on a GPU that cannot run it: keep the request so the validator reports it
        # (rule flag flex_backend_gpu, with its fix) instead of silently keeping alltoall.
        m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend = "flex", backend
        m.moe_shared_expert_overlap = False


def _shrink(cfg: RunConfig, args: argparse.Namespace, explicit: set[str], notes: list[str]) -> RunConfig:
    """-g cpu: fit the recipe into CPU processes, keep the user's batch shape, say what was replaced."""
    from mbridge_epoverlap.config.shrink import shrink_for_cpu

    ep = args.expert_model_parallel_size if given(args, "expert_model_parallel_size") else None
    was_flex = cfg.model.moe_token_dispatcher_type == "flex"
    shrunk = shrink_for_cpu(cfg, cfg.num_gpus, ep=ep)
    for key in sorted(explicit):
        if key in CPU_KEPT_KEYS:
            section, name = key.split(".")
            setattr(getattr(shrunk, section), name, get_path(cfg, key))
        elif key.startswith("model.") and key != "model.expert_model_parallel_size" \
                and get_path(shrunk, key) != get_path(cfg, key):
            notes.append(f"-g cpu replaced {key}={get_path(cfg, key)!r} with {get_path(shrunk, key)!r} (CPU shape)")
    if given(args, "gpus_per_node"):
        shrunk.gpus_per_node = args.gpus_per_node
    if was_flex:
        notes.append("-g cpu runs the flex dispatcher (DeepEP/HybridEP need GPUs) as alltoall")
    # The CPU reference runtime has no Transformer Engine, whose grad-reduce hooks are what the
    # delayed-wgrad TE-version rule guards; it reduces gradients after backward, so the recipe's
    # overlap_grad_reduce is turned off here (equally in every A/B case) unless the user set it.
    user_set = {"ddp.overlap_grad_reduce", "comm_overlap.overlap_grad_reduce"} & explicit
    if not user_set and (shrunk.ddp.overlap_grad_reduce or shrunk.comm_overlap.overlap_grad_reduce):
        shrunk.ddp.overlap_grad_reduce = False
        shrunk.comm_overlap.overlap_grad_reduce = None
        notes.append("-g cpu: ddp.overlap_grad_reduce=false (the CPU runtime reduces gradients after backward)")
    return shrunk


def _stand_ins(cfg: RunConfig) -> list[str]:
    """-g cpu: what stands in for the recipe's layer kinds that the reference runtime has no block for."""
    from mbridge_epoverlap.config.shrink import stand_ins
    from mbridge_epoverlap.recipes.bridge_models import BY_NAME

    replaced = stand_ins(cfg.model)
    if cfg.recipe in BY_NAME and BY_NAME[cfg.recipe].vision:
        replaced.append("the vision tower is left out: the CPU model trains on text tokens only")
    return replaced


RECOMPUTE_KEYS = ("model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers",
                  "model.recompute_modules")


def _drop_recipe_recompute(cfg: RunConfig, explicit: set[str]) -> list[str]:
    """-g cpu: the recipe's activation recompute, which the reference runtime does not do, is left out (several
    recipes recompute the MoE block or whole layers, which EP overlap refuses on a GPU); the user's own is kept."""
    m = cfg.model
    if (m.recompute_granularity is None and not m.recompute_modules) or explicit & set(RECOMPUTE_KEYS):
        return []
    what = ", ".join(f"{key.split('.', 1)[1]}={get_path(cfg, key)!r}" for key in RECOMPUTE_KEYS
                     if get_path(cfg, key) is not None)
    m.recompute_granularity = m.recompute_method = m.recompute_num_layers = m.recompute_modules = None
    return [f"the recipe's activation recompute ({what}) is left out: the reference runtime keeps every "
            "activation (on a GPU, --dryrun validates it with EP overlap)"]


def _mixed_precision(cfg: RunConfig, args: argparse.Namespace) -> str | None:
    if given(args, "compute_dtype") and args.compute_dtype in MIXED_PRECISION:
        return MIXED_PRECISION[args.compute_dtype]
    if cfg.model.bf16:
        return MIXED_PRECISION["bf16"]
    if cfg.model.fp16:
        return MIXED_PRECISION["fp16"]
    return None

