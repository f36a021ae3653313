"""Every flag of Megatron-Bridge's `scripts/performance/run_script.py`, as facts read from its argument_parser.py.

One row per flag: long and short name, kind (value, switch, append), upstream type, default, choices,
nargs, and where the flag goes here:

- `harness`: the project acts on it (recipe, layout, overlap switches, Slurm account/partition/time, ...);
- `sbatch`: written into the sbatch script (container, mounts, environment, srun arguments, gres, extra
  Slurm parameters) or, for nemo-run executor settings with no sbatch equivalent, recorded there;
- `job`: handed to the Megatron-Bridge job (`harness/mbridge_job.py`), which writes the settings it knows
  onto the ConfigContainer and reports the rest;
- `kubeflow`: Kubeflow executor settings (this project launches with Slurm or locally): recorded only;
- `checks`: convergence/performance checks against golden values: recorded for the job record.

Upstream's default -1 (`-vp`, `--moe_flex_dispatcher_backend`) means "flag omitted, keep the recipe's value",
which is what `UNSET` means here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class UpstreamFlag:
    """One flag of Megatron-Bridge's run_script.py."""

    long: str
    short: str | None
    kind: str  # "value", "switch" (store_true) or "append"
    type: str | None  # upstream converter: str, lower_str, int, float, bool, list_of_strings, ...
    default: Any
    destination: str  # harness, sbatch, job, kubeflow, checks
    choices: tuple | None = None
    nargs: str | None = None

    @property
    def dest(self) -> str:
        return self.long.removeprefix("--")


F = UpstreamFlag

UPSTREAM_FLAGS: tuple[UpstreamFlag, ...] = (
    F('--domain', None, 'value', 'lower_str', 'llm', 'job', choices=('llm', 'vlm', 'qwen3vl', 'diffusion')),
    F('--model_family_name', '-m', 'value', 'lower_str', None, 'harness'),
    F('--model_recipe_name', '-mr', 'value', 'lower_str', None, 'harness'),
    F('--use_recipes', None, 'switch', None, False, 'harness'),
    F('--nemo_home', '-nh', 'value', 'str', '~/.cache/nemo', 'sbatch'),
    F('--detach', None, 'value', 'bool', True, 'harness'),
    F('--max_retries', None, 'value', 'int', 2, 'sbatch'),
    F('--num_gpus', '-ng', 'value', 'int', None, 'harness'),
    F('--hidden_size', None, 'value', 'int', None, 'job'),
    F('--num_layers', None, 'value', 'int', None, 'job'),
    F('--num_moe_experts', None, 'value', 'int', None, 'job'),
    F('--pipeline_model_parallel_layout', None, 'value', 'str', None, 'job'),
    F('--first_k_dense_replace', None, 'value', 'int', None, 'job'),
    F('--dryrun', '-d', 'switch', None, False, 'harness'),
    F('--task', None, 'value', 'str', 'pretrain', 'harness', choices=('pretrain', 'sft', 'peft')),
    F('--max_steps', '-ms', 'value', 'int', None, 'harness'),
    F('--global_batch_size', '-gb', 'value', 'int', None, 'harness'),
    F('--micro_batch_size', '-mb', 'value', 'int', None, 'harness'),
    F('--seq_length', '-sl', 'value', 'int', None, 'harness'),
    F('--distributed_timeout_minutes', None, 'value', 'int', None, 'job'),
    F('--lr', None, 'value', 'float', None, 'job'),
    F('--min_lr', None, 'value', 'float', None, 'job'),
    F('--warmup_iters', None, 'value', 'int', 10, 'job'),
    F('--pretrained_checkpoint', None, 'value', 'str', None, 'job'),
    F('--save_dir', None, 'value', 'str', None, 'job'),
    F('--load_dir', None, 'value', 'str', None, 'job'),
    F('--save_interval', None, 'value', 'int', None, 'job'),
    F('--most_recent_k', None, 'value', 'int', None, 'job'),
    F('--data', None, 'value', 'str', 'mock', 'job', choices=('mock', 'rp2', 'squad', 'squad_packed', 'c4')),
    F('--c4_root', None, 'value', 'str', None, 'job'),
    F('--c4_train_shards', None, 'value', 'int', [6], 'job', nargs='+'),
    F('--dataset_paths', None, 'value', 'str', None, 'job', nargs='*'),
    F('--dataset_root', None, 'value', 'str', None, 'job'),
    F('--index_mapping_dir', None, 'value', 'str', None, 'job'),
    F('--dataset_name', None, 'value', 'str', None, 'job'),
    F('--packed_sequence', None, 'switch', None, False, 'job'),
    F('--head_only', None, 'switch', None, False, 'job'),
    F('--diffusion_dataset_path', None, 'value', 'str', None, 'job'),
    F('--tokenizer_type', None, 'value', 'str', None, 'harness',
      choices=('NullTokenizer', 'HuggingFaceTokenizer', 'SentencePieceTokenizer')),
    F('--tokenizer_model', None, 'value', 'str', None, 'job'),
    F('--vocab_size', None, 'value', 'int', 32000, 'job'),
    F('--hf_token', '-hf', 'value', 'str', None, 'sbatch'),
    F('--offline', None, 'switch', None, False, 'sbatch'),
    F('--tensor_model_parallel_size', '-tp', 'value', 'int', None, 'harness'),
    F('--pipeline_model_parallel_size', '-pp', 'value', 'int', None, 'harness'),
    F('--context_parallel_size', '-cp', 'value', 'int', None, 'harness'),
    F('--virtual_pipeline_model_parallel_size', '-vp', 'value', 'none_or_int', -1, 'harness'),
    F('--expert_model_parallel_size', '-ep', 'value', 'int', None, 'harness'),
    F('--expert_tensor_parallel_size', '-et', 'value', 'int', None, 'harness', nargs='?'),
    F('--account', '-a', 'value', 'str', None, 'harness'),
    F('--partition', '-p', 'value', 'str', None, 'harness'),
    F('--time_limit', '-t', 'value', 'str', '00:30:00', 'harness'),
    F('--preempt_time', None, 'value', 'int', 60, 'sbatch'),
    F('--gpus_per_node', '-gn', 'value', 'int', None, 'harness'),
    F('--container_image', '-i', 'value', 'str', 'nvcr.io/nvidia/nemo:dev', 'sbatch'),
    F('--custom_mounts', '-cm', 'value', 'list_of_strings', [], 'sbatch'),
    F('--custom_env_vars', '-ce', 'value', 'dict', {}, 'sbatch'),
    F('--env', '-E', 'append', 'key_value', None, 'sbatch'),
    F('--custom_srun_args', '-cs', 'value', 'list_of_strings', [], 'sbatch'),
    F('--custom_bash_cmds', '-cb', 'append', 'str', None, 'sbatch', nargs='*'),
    F('--gres', None, 'value', 'str', None, 'sbatch'),
    F('--additional_slurm_params', None, 'value', 'slurm_params', None, 'sbatch'),
    F('--packager', None, 'value', 'str', 'git', 'sbatch', choices=('git', 'none')),
    F('--enable_pct_binding', None, 'value', 'bool', True, 'sbatch'),
    F('--kubeflow_namespace', None, 'value', 'str', None, 'kubeflow'),
    F('--csp', None, 'value', 'str', None, 'kubeflow', choices=('aws', 'gcp')),
    F('--kubeflow_workdir_pvc', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_workdir_pvc_path', None, 'value', 'str', '/nemo_run', 'kubeflow'),
    F('--kubeflow_workdir_local_path', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_image_pull_secrets', None, 'value', 'list_of_strings', [], 'kubeflow'),
    F('--kubeflow_volumes_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_volume_mounts_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_tolerations_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_affinity_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_env_list_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_extra_resource_requests_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_extra_resource_limits_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_pod_spec_overrides_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_pod_annotations_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_container_kwargs_json', None, 'value', 'str', None, 'kubeflow'),
    F('--kubeflow_labels_json', None, 'value', 'str', None, 'kubeflow'),
    F('--gpu', '-g', 'value', 'str', None, 'harness',
      choices=('h100', 'b200', 'b300', 'gb200', 'gb300', 'vr200', 'r100')),
    F('--compute_dtype', '-c', 'value', 'str', 'bf16', 'harness',
      choices=('bf16', 'fp8_cs', 'fp8_mx', 'fp8_sc', 'nvfp4')),
    F('--optimizer_type', None, 'value', 'str', 'muon', 'job', choices=('adam', 'muon')),
    F('--enable_vboost', '-vb', 'value', 'bool', None, 'sbatch'),
    F('--lock_gpu_freq', '-lgc', 'value', 'int', None, 'sbatch'),
    F('--peak_mem_clk', '-lmc', 'value', 'int', None, 'sbatch'),
    F('--enable_nsys', '-en', 'switch', None, False, 'harness'),
    F('--export_nsys_sqlite', None, 'switch', None, False, 'job'),
    F('--pytorch_profiler', '-pyp', 'value', 'bool', False, 'harness'),
    F('--profiling_start_step', None, 'value', 'int', 10, 'harness'),
    F('--profiling_stop_step', None, 'value', 'int', 11, 'harness'),
    F('--record_memory_history', '-mh', 'value', 'bool', True, 'job'),
    F('--profiling_gpu_metrics', None, 'switch', None, False, 'job'),
    F('--profiling_ranks', None, 'value', 'list_of_ints', None, 'job'),
    F('--nsys_trace', None, 'value', 'list_of_strings', None, 'sbatch'),
    F('--nsys_extra_args', None, 'value', 'list_of_strings', None, 'sbatch'),
    F('--use_tokendrop', None, 'value', 'bool', None, 'job'),
    F('--use_megatron_fsdp', None, 'value', 'bool', None, 'job'),
    F('--nccl_ub', None, 'value', 'bool', None, 'job'),
    F('--cuda_graph_impl', None, 'value', 'cuda_graph_impl', None, 'harness'),
    F('--cuda_graph_scope', None, 'value', 'cuda_graph_scope', None, 'harness'),
    F('--moe_a2a_overlap', None, 'value', 'bool', None, 'harness'),
    F('--recompute_num_layers', '-rl', 'value', 'int', None, 'harness'),
    F('--activation_offload_layers', '-ol', 'value', 'int', None, 'job'),
    F('--recompute_modules', None, 'value', 'list_of_strings', None, 'harness'),
    F('--moe_flex_dispatcher_backend', None, 'value', 'none_or_str', -1, 'harness',
      choices=('deepep', 'hybridep', 'ncclep', None)),
    F('--deterministic', None, 'switch', None, False, 'job'),
    F('--wandb_key', '-wdk', 'value', 'str', None, 'job'),
    F('--wandb_project_name', '-wdp', 'value', 'str', None, 'job'),
    F('--wandb_entity_name', '-wde', 'value', 'str', None, 'job'),
    F('--wandb_experiment_name', '-wdj', 'value', 'str', None, 'job'),
    F('--wandb_save_dir', '-wds', 'value', 'str', None, 'job'),
    F('--log_dir', '-l', 'value', 'str', None, 'sbatch'),
    F('--save_config_filepath', None, 'value', 'str', None, 'harness'),
    F('--dump_env', None, 'switch', None, False, 'sbatch'),
    F('--config_variant', '-cv', 'value', 'str', None, 'harness'),
    F('--list_config_variants', None, 'switch', None, False, 'harness'),
    F('--is_long_convergence_run', None, 'switch', None, False, 'checks'),
    F('--retry_on_testing_failure', None, 'switch', None, False, 'checks'),
    F('--golden_values_path', None, 'value', 'str', None, 'checks'),
    F('--timing_threshold', None, 'value', 'float', 0.05, 'checks'),
    F('--skip_first_percent_time', None, 'value', 'float', 0.7, 'checks'),
    F('--correlation_threshold', None, 'value', 'float', 0.95, 'checks'),
    F('--high_loss_tolerance', None, 'value', 'float', 0.1, 'checks'),
    F('--medium_loss_tolerance', None, 'value', 'float', 0.05, 'checks'),
    F('--low_loss_tolerance', None, 'value', 'float', 0.02, 'checks'),
    F('--final_loss_tolerance', None, 'value', 'float', 0.05, 'checks'),
    F('--max_outlier_ratio', None, 'value', 'float', 0.1, 'checks'),
    F('--outlier_threshold', None, 'value', 'float', 3.0, 'checks'),
    F('--skip_first_percent_loss', None, 'value', 'float', 0.2, 'checks'),
    F('--memory_threshold', None, 'value', 'float', 0.05, 'checks'),
    F('--eval_time_start_step', None, 'value', 'int', None, 'checks'),
    F('--eval_time_end_step', None, 'value', 'int', None, 'checks'),
)

OMITTED = -1  # upstream's "flag not given" default of -vp and --moe_flex_dispatcher_backend
# Defaults upstream reads from the environment when the parser is built (argument_parser.py).
ENV_DEFAULTS = {"nemo_home": "NEMO_HOME"}


class EnvDefault(str):
    """A default taken from an environment variable; `text` says so (for the docs, whatever the machine)."""

    text: str


def default_of(flag: UpstreamFlag) -> Any:
    """The flag's default as upstream computes it: `--nemo_home` is `$NEMO_HOME`, else `~/.cache/nemo`."""
    import os

    variable = ENV_DEFAULTS.get(flag.dest)
    if variable is None:
        return flag.default
    value = EnvDefault(os.environ.get(variable, flag.default))
    value.text = f"${variable}, else {flag.default}"
    return value


# ---- Parsing -------------------------------------------------------------------------------------------------


def _converter(type_name: str | None):
    """The argparse `type` for an upstream converter name (errors name the expected form)."""
    import argparse

    from mbridge_epoverlap.arg_types import bool_arg, integer, number

    def list_of_ints(text: str) -> list[int]:
        try:
            return [int(part, 10) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None

    def mapping(text: str) -> dict[str, str]:
        pairs = [item.partition("=") for item in text.split(",") if item]
        if any(not sep or not key for key, sep, _ in pairs):
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        return {key: value for key, _, value in pairs}

    def key_value(text: str) -> tuple[str, str]:
        key, sep, value = text.partition("=")
        if not sep or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME a variable name, got {text!r}")
        return key, value

    def slurm_params(text: str) -> dict[str, str | bool] | None:
        parts = text.split(";") if ";" in text else text.split() if " " in text else [text]
        found: dict[str, str | bool] = {}
        for part in (p.strip() for p in parts):
            if part:
                key, sep, value = part.partition("=")
                found[key.strip()] = value.strip() if sep else True
        return found or None

    def list_of_strings(text: str) -> list[str]:
        return text.split(",")

    table = {None: str, "str": str, "lower_str": str.lower, "int": integer, "float": number, "bool": bool_arg,
             "list_of_strings": list_of_strings, "list_of_ints": list_of_ints, "dict": mapping,
             "key_value": key_value, "slurm_params": slurm_params}
    return table[type_name]


def add_upstream_flags(parser: Any) -> list[UpstreamFlag]:
    """Add every upstream flag `parser` does not define yet, with upstream's names, type, default and choices.

    Returns the flags added (the pass-through ones and the few upstream harness flags defined here).
    """
    have = {option for action in parser._actions for option in action.option_strings}
    group = parser.add_argument_group(
        "Megatron-Bridge run_script.py flags (same names, types and defaults; see --dryrun for where each goes)")
    added = []
    for flag in UPSTREAM_FLAGS:
        if flag.long in have:
            continue
        names = [flag.short, flag.long] if flag.short and flag.short not in have else [flag.long]
        help_text = f"Megatron-Bridge flag, goes to: {flag.destination}"
        if flag.kind == "switch":
            group.add_argument(*names, action="store_true", default=flag.default, help=help_text)
        else:
            kwargs: dict[str, Any] = {"type": _converter(flag.type), "default": default_of(flag), "help": help_text}
            if flag.choices:
                kwargs["choices"] = list(flag.choices)
            if flag.nargs:
                kwargs["nargs"] = flag.nargs
            if flag.kind == "append":
                kwargs["action"] = "append"
            group.add_argument(*names, **kwargs)
        added.append(flag)
    return added


# ---- Where the given flags go -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """A given pass-through flag and where it went."""

    flag: str
    value: Any
    destination: str
    effect: str


# sbatch-script effects of the flags that have one; the other sbatch flags are recorded as comments.
SBATCH_EFFECTS = {
    "container_image": "srun --container-image",
    "custom_mounts": "srun --container-mounts",
    "custom_env_vars": "export before the runs",
    "env": "export before the runs",
    "custom_srun_args": "extra srun arguments",
    "custom_bash_cmds": "commands before the runs",
    "gres": "#SBATCH --gres",
    "additional_slurm_params": "#SBATCH --KEY=VALUE lines",
    "hf_token": "export HF_TOKEN",
    "nemo_home": "export NEMO_HOME",
    "offline": "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1",
    "nsys_trace": "nsys profile --trace of the profiled runs (replaces the default cuda,nvtx)",
    "nsys_extra_args": "options of the profiled runs' nsys profile (one naming a default option replaces it, "
                       "as Megatron-Bridge main does since #4669)",
}
EFFECTS = {"job": "handed to the Megatron-Bridge job (applied where its ConfigContainer has the setting)",
           "kubeflow": "recorded only (this project launches with Slurm or locally, not Kubeflow)",
           "checks": "recorded with the job (golden-value checks are not run by this project)"}


def passthrough_routes(args: Any) -> list[Route]:
    """Every pass-through flag given with a value other than upstream's default, and where it goes."""
    routes = []
    for flag in UPSTREAM_FLAGS:
        if flag.destination == "harness":
            continue
        default = default_of(flag)
        value = getattr(args, flag.dest, default)
        if value == default:
            continue
        if flag.destination == "sbatch":
            effect = SBATCH_EFFECTS.get(flag.dest, "recorded in the sbatch script (a nemo-run executor setting "
                                                   "with no sbatch equivalent)")
        else:
            effect = EFFECTS[flag.destination]
        routes.append(Route(flag.long, value, flag.destination, effect))
    return routes


def job_settings(routes: list[Route]) -> dict[str, Any]:
    """The pass-through values the Megatron-Bridge job receives (`job` and `checks` flags), by dest name."""
    return {r.flag.removeprefix("--"): r.value for r in routes if r.destination in ("job", "checks")}
