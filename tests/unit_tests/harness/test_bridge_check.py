"""`--check_with_bridge`: the job's ConfigContainer built and validated by the real Megatron-Bridge on a CPU.

The comparison and the offline model configs are tested here without Megatron-Bridge; the check itself runs
where the Python 3.12 environment with Megatron-Bridge exists (`MBRIDGE_EPOVERLAP_BRIDGE_PYTHON`, built by
scripts/setup_bridge_venv.sh), and is skipped elsewhere. There, every project recipe that Megatron-Bridge has
a recipe for is checked on every GPU type of the catalog whose compute capability is known, all in one
Megatron-Bridge process: the harness and Bridge must give the same verdict on each A/B case, and on the
accepted ones the same effective settings and the same job, field by field.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from mbridge_epoverlap.gpus import GPU_FACTS
from mbridge_epoverlap.harness import recipe_facts
from mbridge_epoverlap.harness.bridge_check import BridgeOutcome, CheckJob, disagreements, run_checks
from mbridge_epoverlap.harness.bridge_recipes import FLAG_PRECISION, choose_perf_recipe
from mbridge_epoverlap.harness.cases import case_of, case_specs
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.harness.hf_configs import (
    HF_MODELS,
    RELEASED_MODELS,
    deepseek_v3_hf_config,
    qwen3_moe_hf_config,
    write_hf_cache,
)
from mbridge_epoverlap.harness.job_options import bridge_lookup
from mbridge_epoverlap.harness.main import main
from mbridge_epoverlap.harness.resolve import resolve
from mbridge_epoverlap.recipes import FAMILIES
from mbridge_epoverlap.recipes.bridge_models import BY_NAME, recipe_parts, reference_recipe
from mbridge_epoverlap.recipes.loader import family_of, load_recipe
from tests.unit_tests.requirements import require_or_skip

BRIDGE_PYTHON = os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON")
# The catalog's GPUs that can be mocked (VR200 and R100: compute capability not known here).
CHECKABLE_GPUS = [key for key, facts in GPU_FACTS.items() if facts.compute_capability is not None]


# Megatron-Bridge rejections about settings the run config does not carry, so no EP-overlap verdict of the harness
# can match them: GPT-OSS 20B's recipes turn on the dataloader's fast cache, whose cache path upstream's data flags
# give the job (the recipe alone, as built here, has none); Nemotron 3 Ultra's GB200 recipe sets both of DDP's
# num_buckets and bucket_size, which Megatron-Core's DDP config refuses (the recipe as released fails there).
OUTSIDE_THE_RUN_CONFIG = ("--data-cache-path must be provided", "Cannot specify both num_buckets and bucket_size")


def _case(name: str, overlap: bool, changes: dict | None = None):
    cfg = load_recipe("qwen3_30b_a3b")
    cfg.comm_overlap.overlap_moe_expert_parallel_comm = overlap
    return SimpleNamespace(name=name, cfg=cfg, changes=changes or {})


def test_disagreements_name_the_case_and_the_setting():
    cases = [_case("on", True), _case("off", False)]
    outcomes = [BridgeOutcome("on", True, None, overlap=False, delay_wgrad=False, dispatcher="alltoall"),
                BridgeOutcome("off", False, "AssertionError: no")]
    lines = disagreements(cases, outcomes)
    assert lines == ["case on: Megatron-Bridge runs it differently (overlap: case True, Megatron-Bridge False)",
                     "case off: Megatron-Bridge rejects the job: AssertionError: no"]
    agreeing = [BridgeOutcome("on", True, None, overlap=True, delay_wgrad=False, dispatcher="alltoall")]
    assert disagreements(cases[:1], agreeing) == []
    flex = [BridgeOutcome("on", True, None, overlap=True, delay_wgrad=False, dispatcher="flex", backend="hybridep")]
    assert disagreements(cases[:1], flex) == [
        "case on: Megatron-Bridge runs it differently (dispatcher: case 'alltoall', Megatron-Bridge 'flex', backend: "
        "case None, Megatron-Bridge 'hybridep')"]
    stale = [BridgeOutcome("on", True, None, overlap=True, delay_wgrad=False, dispatcher="alltoall",
                           fields={"model.moe_permute_fusion": [False, True]})]
    assert disagreements(cases[:1], stale) == [
        "case on: the job Megatron-Bridge builds is not the config validated here (model.moe_permute_fusion: "
        "validated False, Megatron-Bridge True)"]


def test_the_offline_model_config_is_found_at_every_pinned_revision(tmp_path):
    config = qwen3_moe_hf_config(load_recipe("qwen3_30b_a3b").model)
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (128, 8, 768)
    write_hf_cache(tmp_path, "Qwen/Qwen3-30B-A3B", config, {"abc123"})
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B"
    main_revision = (repo / "refs" / "main").read_text()
    for revision in (main_revision, "abc123"):
        assert json.loads((repo / "snapshots" / revision / "config.json").read_text()) == config


def test_deepseek_v3_config_carries_the_recipe_dimensions():
    config = deepseek_v3_hf_config(load_recipe("deepseek_v3").model)
    assert (config["num_hidden_layers"], config["first_k_dense_replace"], config["n_routed_experts"]) == (61, 3, 256)
    assert (config["n_shared_experts"], config["num_nextn_predict_layers"]) == (1, 1)
    assert config["scoring_func"] == "sigmoid"
    assert (config["v_head_dim"], config["moe_intermediate_size"], config["vocab_size"]) == (128, 2048, 129280)


def test_every_family_is_mapped_or_named_as_having_no_upstream_recipe():
    """Families without a Megatron-Bridge recipe are the documented ones; every other recipe is checkable."""
    facts = json.loads((Path(__file__).parent / "data" / "megatron_bridge_facts.json").read_text())
    unmapped = {name for names in FAMILIES.values() for name in names} - set(HF_MODELS)
    assert unmapped == {"mixtral_8x22b", "dbrx"}
    for name in unmapped:
        assert family_of(name) not in facts["recipes"] and family_of(name) not in facts["perf_recipes"]
    doc = (Path(__file__).resolve().parents[3] / "docs" / "training" / "communication-overlap.md").read_text()
    assert "Mixtral and DBRX" in doc and "no upstream recipe" in doc


@pytest.fixture(scope="module")
def bridge_python() -> str:
    if not BRIDGE_PYTHON or not Path(BRIDGE_PYTHON).exists():
        require_or_skip("bridge", "set MBRIDGE_EPOVERLAP_BRIDGE_PYTHON (scripts/setup_bridge_venv.sh builds it)")
    return BRIDGE_PYTHON


def _job(recipe: str, gpu: str, task: str = "pretrain", precision: str = "bf16"):
    """The `--ab ep_overlap` job of `recipe` on `gpu` as the harness builds it (unvalidated cases and each one's
    verdict): the performance recipe at its tuned GPU count, or the library recipe where the GPU has none."""
    argv = ["-mr", recipe, "-g", gpu, "--te_version", "2.12", "--torch_version", "2.7", "--mcore_version", "0.19",
            "--ab", "ep_overlap", "--task", task, "-c", precision]
    try:
        chosen = choose_perf_recipe(recipe_facts.perf_recipe_names(), family=family_of(recipe), model=recipe,
                                    task=task, gpu=gpu, compute_dtype=precision, num_gpus=None)
        argv += ["-ng", str(chosen.num_gpus)]
    except Exception:  # noqa: BLE001 - no performance recipe for this GPU: the library recipe, as upstream falls back
        argv.append("--use_recipes")
    args = build_parser().parse_intermixed_args(argv)
    resolved = resolve(args)
    cases = [case_of(resolved, spec) for spec in case_specs(args.ab, resolved.cfg, resolved.explicit)]
    verdicts = [sorted({v.rule for v in c.cfg.validate(resolved.target.env) if v.severity == "error"}) for c in cases]
    choose = {"family": family_of(recipe), "name": recipe, "task": task, **bridge_lookup(args, resolved.cfg)}
    job = CheckJob(choose, cases, gpu, resolved.cfg.num_gpus, resolved.max_steps, "2.12", resolved.cfg)
    return job, verdicts, resolved


def _pairs() -> list[tuple[str, str, str, str]]:
    """(recipe, GPU, task, -c) of each job: the hand-written recipes on every checkable GPU (the library recipe where
    the GPU has no performance recipe); each workload taken from Megatron-Bridge's recipes as its reference recipe."""
    pairs = [(recipe, gpu, "pretrain", "bf16") for recipe in sorted(set(HF_MODELS) - set(RELEASED_MODELS))
             for gpu in CHECKABLE_GPUS]
    for workload in sorted(RELEASED_MODELS):
        parts = recipe_parts(reference_recipe(BY_NAME[workload]).rpartition(".")[2])
        if parts["gpu"] in CHECKABLE_GPUS:
            pairs.append((workload, parts["gpu"], parts["task"], FLAG_PRECISION[parts["precision"]]))
    return pairs


@pytest.fixture(scope="module")
def checked(bridge_python):
    """Every pair of `_pairs`, checked by Megatron-Bridge in one child process."""
    jobs = [(recipe, gpu, *_job(recipe, gpu, task, precision)) for recipe, gpu, task, precision in _pairs()]
    answers = run_checks([job for _, _, job, _, _ in jobs])
    return [(recipe, gpu, job, verdicts, resolved, answer)
            for (recipe, gpu, job, verdicts, resolved), answer in zip(jobs, answers, strict=True)]


def test_every_mapped_recipe_on_every_gpu_gets_the_verdict_megatron_bridge_gives(checked):
    """The harness validates the job Bridge builds: it accepts what Bridge accepts and rejects what Bridge rejects,
    and on what both accept, Bridge runs the overlap, delayed wgrad, dispatcher and every field validated."""
    tally: Counter[str] = Counter()
    outside: set[str] = set()
    for recipe, gpu, job, verdicts, resolved, (chosen, error, outcomes) in checked:
        assert chosen is not None, f"{recipe} on {gpu}: {error}"
        assert chosen == resolved.upstream.recipe.describe(), (recipe, gpu)  # the recipe the harness validated
        for case, verdict, outcome in zip(job.cases, verdicts, outcomes, strict=True):
            where = f"{recipe} on {gpu}, case {case.name}"
            if not outcome.ok and not verdict and any(text in outcome.error for text in OUTSIDE_THE_RUN_CONFIG):
                outside.add(recipe)
                continue
            assert outcome.ok is not bool(verdict), f"{where}: harness {verdict or 'accepts'}, Bridge {outcome.error}"
            if outcome.ok:
                assert disagreements([case], [outcome]) == [], where
            tally["accepted" if outcome.ok else "rejected"] += 1
    assert len(checked) == 3 * len(CHECKABLE_GPUS) + len(RELEASED_MODELS) == 45
    assert tally["accepted"] > 0 and tally["rejected"] > 0, tally  # both verdicts occur: the check means something
    assert outside <= {"gpt_oss_20b", "nemotron_3_ultra"}, outside  # nowhere else does such a setting stop the job


def test_the_issue_job_runs_flex_with_overlap_as_the_report_says(checked):
    """The issue's command: Megatron-Bridge's 16-GPU H100 recipe, kept by the job, with the A/B's two switches."""
    (row,) = [row for row in checked if row[:2] == ("qwen3_30b_a3b", "h100")]
    _, _, job, _, _, (chosen, _, outcomes) = row
    assert "qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config" in chosen
    assert [(o.overlap, o.delay_wgrad, o.dispatcher, o.backend) for o in outcomes] == [
        (False, False, "flex", "hybridep"), (True, False, "flex", "hybridep"), (True, True, "flex", "hybridep")]


@pytest.mark.usefixtures("bridge_python")
def test_a_stale_recipe_fact_stops_the_run_before_submission(tmp_path, capsys, monkeypatch):
    """The harness validates the recipe's values from its facts; where they no longer match the Megatron-Bridge
    the job runs (here a fixture saying moe_permute_fusion=False), the check says so and nothing is submitted."""
    facts = json.loads(recipe_facts.FACTS_FILE.read_text())
    name = "megatron.bridge.perf_recipes.qwen.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config"
    facts["recipes"][name]["values"]["model.moe_permute_fusion"] = False
    stale = tmp_path / "facts.json"
    stale.write_text(json.dumps(facts))
    monkeypatch.setattr(recipe_facts, "FACTS_FILE", stale)
    rc = main(["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "--te_version", "2.12", "--dryrun",
               "--check_with_bridge", "--results_json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert ("case run: the job Megatron-Bridge builds is not the config validated here (model.moe_permute_fusion: "
            "validated False, Megatron-Bridge True)") in err
    assert "nothing was submitted" in err


def test_a_gpu_the_catalog_cannot_describe_is_not_checked(tmp_path, capsys, monkeypatch):
    """VR200's compute capability is not known here, so its mock would reject every flex backend (alltoall here,
    which the validator accepts on VR200)."""
    monkeypatch.setenv("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON", "/nonexistent/python")
    rc = main(["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "vr200", "-ng", "8", "-ep", "8", "--dryrun",
               "--moe_flex_dispatcher_backend", "None", "--check_with_bridge", "--results_json",
               str(tmp_path / "r.json")])
    assert rc == 2 and "does not know the compute capability of vr200" in capsys.readouterr().err


def test_a_family_without_an_upstream_recipe_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON", "/nonexistent/python")
    rc = main(["-m", "mixtral", "-g", "h100", "-ng", "64", "--dryrun", "--check_with_bridge", "--results_json",
               str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Megatron-Bridge has no recipe for 'mixtral_8x22b'" in err
