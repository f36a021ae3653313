"""`--check_with_bridge`: the GPU job's ConfigContainer built and validated by the real Megatron-Bridge, on a CPU.

For each case, in the Python that has Megatron-Bridge (this one, or `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON`,
e.g. the environment `scripts/setup_bridge_venv.sh` builds): build the recipe the job would build, apply
the case's changes exactly as the job does (`mbridge_job.apply_changes`), and run Bridge's own
`runtime_config_update` under the target GPU's mock (`config.bridge_cpu`). The outcome says whether every
setting exists, has the right type and survives Bridge's and Core's validation, and which overlap,
delayed wgrad, dispatcher and flex backend Bridge ends with; the harness compares those with what the
A/B case says it runs, so a disagreement is reported before anything is submitted.

Recipes load their Hugging Face config with `AutoBridge.from_hf_pretrained`; the check writes it into a
private offline cache from the project's recipe (the models' public dimensions). Qwen3 MoE recipes are
written so; other families are reported as not checkable here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PYTHON_VAR = "MBRIDGE_EPOVERLAP_BRIDGE_PYTHON"
# Hugging Face model id of each project recipe the check can write a config for.
HF_MODELS = {"qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B", "qwen3_235b_a22b": "Qwen/Qwen3-235B-A22B"}


@dataclass(frozen=True)
class BridgeOutcome:
    """What Megatron-Bridge made of one case."""

    case: str
    ok: bool
    error: str | None
    overlap: bool | None = None
    delay_wgrad: bool | None = None
    dispatcher: str | None = None
    backend: str | None = None


def qwen3_moe_hf_config(model: Any) -> dict[str, Any]:
    """A `qwen3_moe` config.json from a project recipe's model (the public dimensions it carries)."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
            "head_dim": model.kv_channels, "hidden_act": "silu", "hidden_size": model.hidden_size,
            "initializer_range": 0.02, "intermediate_size": model.ffn_hidden_size, "max_position_embeddings": 40960,
            "max_window_layers": model.num_layers, "mlp_only_layers": [], "moe_intermediate_size":
            model.moe_ffn_hidden_size, "norm_topk_prob": True, "num_attention_heads": model.num_attention_heads,
            "num_experts": model.num_moe_experts, "num_experts_per_tok": model.moe_router_topk,
            "num_hidden_layers": model.num_layers, "num_key_value_heads": model.num_query_groups,
            "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
            "vocab_size": model.vocab_size}


def write_hf_cache(home: Path, model_id: str, config: dict[str, Any], revisions: set[str]) -> None:
    """An offline Hugging Face hub cache under `home` holding only `config.json` of `model_id`, at `main` and at
    each pinned revision (recipes pin one)."""
    repo = home / "hub" / f"models--{model_id.replace('/', '--')}"
    main = "0" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(main)
    for revision in {main} | revisions:
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2))


def pinned_revisions(model_id: str) -> set[str]:
    """The revisions of `model_id` that the imported Megatron-Bridge recipes pin (`*_MODEL_REVISION` next to
    a `*_MODEL_ID` naming it)."""
    found = set()
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("megatron.bridge.recipes"):
            continue
        for name, value in list(vars(module).items()):
            if name.endswith("_MODEL_ID") and value == model_id:
                revision = getattr(module, name.removesuffix("_MODEL_ID") + "_MODEL_REVISION", None)
                if isinstance(revision, str):
                    found.add(revision)
    return found


def check_in_bridge(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Run in the Python that has Megatron-Bridge: build, change and validate every case of `request`."""
    from mbridge_epoverlap.config.bridge_cpu import install_fake_te, set_te_version, target_gpu

    install_fake_te()
    import importlib

    from megatron.bridge.training.config import runtime_config_update

    from mbridge_epoverlap.errors import UsageError
    from mbridge_epoverlap.harness.mbridge_job import apply_changes, bridge_recipe, choose_recipe

    set_te_version(request.get("te_version") or "2.12.0")
    try:
        recipe = choose_recipe(**request["choose"])
    except (LookupError, UsageError) as exc:  # no such recipe: what the job itself would stop with
        return [{"recipe": None, "error": str(exc)}]
    importlib.import_module(recipe.module)  # imports the library recipes too, which pin the model revisions
    write_hf_cache(Path(os.environ["HF_HOME"]), request["hf_model"], request["hf_config"],
                   pinned_revisions(request["hf_model"]))
    outcomes = []
    for case in request["cases"]:
        saved = dict(os.environ)
        os.environ["WORLD_SIZE"] = str(request["num_gpus"])
        try:
            with target_gpu(request["gpu"]):
                cfg = bridge_recipe(recipe)
                missing = apply_changes(cfg, case["changes"], max_steps=request["max_steps"])
                if missing:
                    raise LookupError(f"this Megatron-Bridge has no setting for {', '.join(missing)}")
                runtime_config_update(cfg)
            model = cfg.model
            outcomes.append({"case": case["name"], "ok": True, "error": None,
                             "overlap": bool(model.overlap_moe_expert_parallel_comm),
                             "delay_wgrad": bool(model.delay_wgrad_compute),
                             "dispatcher": model.moe_token_dispatcher_type,
                             "backend": model.moe_flex_dispatcher_backend
                             if model.moe_token_dispatcher_type == "flex" else None})
        except Exception as exc:  # noqa: BLE001 - whatever Bridge raises is the answer, reported with its type
            outcomes.append({"case": case["name"], "ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]})
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return [{"recipe": recipe.describe()}, *outcomes]


def bridge_python() -> str | None:
    """The interpreter that has Megatron-Bridge: this one, else `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON`, else None."""
    from mbridge_epoverlap.config.bridge_cpu import bridge_available

    if bridge_available():
        return sys.executable
    return os.environ.get(PYTHON_VAR) or None


def run_check(choose: dict[str, Any], cases: list[Any], *, gpu: str, num_gpus: int, max_steps: int,
              te_version: str | None, project_recipe: Any) -> tuple[str, list[BridgeOutcome]]:
    """Check every case with the real Megatron-Bridge (in a child process): the recipe it chose (`choose`
    holds `mbridge_job.choose_recipe`'s arguments, as the job gets them) and each case's outcome.

    Raises:
        RuntimeError: no Megatron-Bridge to check with, a recipe it cannot write the model config of, or
            the child failed.
    """
    from mbridge_epoverlap.gpus import gpu_facts

    if gpu_facts(gpu).compute_capability is None:
        raise RuntimeError(f"--check_with_bridge mocks the target GPU, but the catalog does not know the compute "
                           f"capability of {gpu} (mbridge_epoverlap/gpus.py); it cannot be checked here")
    python = bridge_python()
    if python is None:
        raise RuntimeError(f"--check_with_bridge needs Megatron-Bridge: install it here, or set {PYTHON_VAR} to a "
                           "Python that has it (scripts/setup_bridge_venv.sh builds one)")
    model_id = HF_MODELS.get(project_recipe.recipe)
    if model_id is None:
        raise RuntimeError(f"--check_with_bridge writes Hugging Face configs for {', '.join(sorted(HF_MODELS))} "
                           f"only; {project_recipe.recipe!r} cannot be checked here")
    request = {"choose": choose,
               "cases": [{"name": case.name, "changes": case.changes} for case in cases],
               "gpu": gpu, "num_gpus": num_gpus, "max_steps": max_steps, "te_version": te_version,
               "hf_model": model_id, "hf_config": qwen3_moe_hf_config(project_recipe.model)}
    with tempfile.TemporaryDirectory(prefix="mbridge-check-") as home:
        env = dict(os.environ, HF_HOME=home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        proc = subprocess.run([python, "-m", "mbridge_epoverlap.harness.bridge_check"], input=json.dumps(request),
                              capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"the Megatron-Bridge check failed to run: {proc.stderr.strip()[-1500:]}")
    first, *outcomes = json.loads(proc.stdout.strip().splitlines()[-1])
    if first["recipe"] is None:
        raise RuntimeError(f"Megatron-Bridge builds no recipe for this job: {first['error']}")
    return first["recipe"], [BridgeOutcome(**item) for item in outcomes]


def disagreements(cases: list[Any], outcomes: list[BridgeOutcome]) -> list[str]:
    """Where Megatron-Bridge's outcome differs from what the A/B case says it runs (one line each)."""
    lines = []
    for case, outcome in zip(cases, outcomes, strict=True):
        if not outcome.ok:
            lines.append(f"case {case.name}: Megatron-Bridge rejects the job: {outcome.error}")
            continue
        m = case.cfg.model
        ours = {"overlap": case.cfg.comm_overlap.effective_overlap(m),
                "delay_wgrad": case.cfg.comm_overlap.effective_delay_wgrad(m)}
        if "model.moe_token_dispatcher_type" in case.changes or "model.moe_flex_dispatcher_backend" in case.changes:
            ours["dispatcher"] = m.moe_token_dispatcher_type
            ours["backend"] = m.moe_flex_dispatcher_backend if m.moe_token_dispatcher_type == "flex" else None
        theirs = {key: getattr(outcome, key) for key in ours}
        if ours != theirs:
            diff = ", ".join(f"{key}: case {ours[key]!r}, Megatron-Bridge {theirs[key]!r}" for key in ours
                             if ours[key] != theirs[key])
            lines.append(f"case {case.name}: Megatron-Bridge runs it differently ({diff})")
    return lines


def _main() -> int:
    import contextlib

    request = json.loads(sys.stdin.read())
    with contextlib.redirect_stdout(sys.stderr):  # the libraries log to stdout; it carries the answer only
        outcomes = check_in_bridge(request)
    print(json.dumps(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
