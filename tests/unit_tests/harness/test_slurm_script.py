"""Dry runs for Slurm: the sbatch script of multi-node GPU targets and of CPU jobs."""

from __future__ import annotations

import json
import re
import subprocess

import yaml

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.harness.executors.slurm import last_error_line
from mbridge_epoverlap.harness.main import main


def dry_run(tmp_path, capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([*argv, "--dryrun", "--results_json", str(tmp_path / "ab.json")])
    out = capsys.readouterr()
    return rc, out.out, out.err


def directives(script: str) -> dict[str, str]:
    found = {}
    for line in script.splitlines():
        m = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line)
        if m:
            found[m.group(1)] = m.group(2) or ""
    return found


def test_upstream_passthrough_flags_reach_the_script(tmp_path, capsys):
    """Megatron-Bridge run_script.py flags this harness does not act on itself land in the sbatch script or
    the job, and the dry run says where each went."""
    rc, script, err = dry_run(tmp_path, capsys, "-mr", "qwen3_30b_a3b", "-g", "gb200", "-ng", "8", "-gn", "4",
                              "-ep", "8",
                              "-i", "nvcr.io/nvidia/nemo:25.09", "-cm", "/data:/data,/ckpt:/ckpt", "--gres", "gpu:4",
                              "--additional_slurm_params", "constraint=gpu;exclusive", "-E", "NCCL_DEBUG=INFO",
                              "-ce", "A=1,B=2", "--custom_srun_args=--mpi=pmix", "-cb", "module", "load", "cuda",
                              "--lr", "1e-4", "--use_recipes", "--moe_flex_dispatcher_backend", "hybridep",
                              "--kubeflow_namespace", "ns")
    assert rc == 0, err
    d = directives(script)
    assert (d["gres"], d["constraint"], d["exclusive"]) == ("gpu:4", "gpu", "")
    srun = "--container-image=nvcr.io/nvidia/nemo:25.09 --container-mounts=/data:/data,/ckpt:/ckpt --mpi=pmix"
    assert srun in script
    for line in ("export NCCL_DEBUG=INFO", "export A=1", "export B=2", "module load cuda",
                 "export NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8", "export NVLINK_DOMAIN_SIZE=72",
                 "export USE_MNNVL=1"):
        assert line in script.splitlines(), line
    # The library recipe has no launch environment, and no -tp/-cp/--moe_a2a_overlap asks for a connection count:
    # CUDA's default stays, as with Megatron-Bridge's run_script.py.
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in script
    assert "--use-recipes --job-settings '{\"lr\": 0.0001}'" in script
    assert "megatron.bridge.recipes.qwen.qwen3_30b_a3b_pretrain_config (library recipe)" in script
    assert "--kubeflow_namespace='ns' -> kubeflow: recorded only" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_h100_two_nodes(tmp_path, capsys):
    rc, script, err = dry_run(tmp_path, capsys, "-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16",
                              "-gn", "8", "--te_version", "2.12", "--ab", "ep_overlap", "-a", "myacct", "-p", "batch",
                              "-t", "01:00:00", "--tokenizer_type", "NullTokenizer")
    assert rc == 0, err
    d = directives(script)
    assert (d["nodes"], d["ntasks"], d["ntasks-per-node"], d["gpus-per-node"]) == ("2", "16", "8", "8")
    assert (d["time"], d["account"], d["partition"]) == ("01:00:00", "myacct", "batch")
    assert d["output"].endswith("ab.slurm/slurm-%j.out")
    # Megatron-Bridge's recipe runs HybridEP: the cases switch EP overlap (as --moe_a2a_overlap would), which
    # recomputes the connection count from the recipe's backend; its HybridEP topology is exported too.
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=32" in script and "export CUDA_DEVICE_MAX_CONNECTIONS=8" not in script
    assert "export NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8" in script
    assert "perf_recipes.qwen.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config" in script  # upstream's default recipe
    assert "--gpu h100 --compute-dtype bf16 --num-gpus 16" in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in script
    assert "srun --ntasks=16 --ntasks-per-node=8" in script and "MASTER_PORT" in script
    assert "import megatron.bridge" in script and "mbridge_epoverlap.harness.mbridge_job" in script
    assert "--tokenizer-type NullTokenizer" in script and "--mixed-precision bf16_mixed" in script
    order = re.findall(r"^run_case (\S+) 1 (\d+)", script, re.M)
    assert order == [("ep_overlap_off", "0"), ("ep_overlap_on", "1"), ("ep_overlap_on_delay_wgrad", "2")]
    assert "sbatch" in err and "not submitted" in err
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)

    job = tmp_path / "ab.slurm"
    assert (job / "job.sbatch").read_text() == script
    for name in ("ep_overlap_off", "ep_overlap_on", "ep_overlap_on_delay_wgrad"):
        cfg = RunConfig.from_dict(yaml.safe_load((job / "configs" / f"{name}.yaml").read_text()))
        assert cfg.model.expert_model_parallel_size == 16 and cfg.num_gpus == 16
        assert cfg.env_vars["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    plan = json.loads((job / "plan.json").read_text())
    assert [c["name"] for c in plan["cases"]] == ["ep_overlap_off", "ep_overlap_on", "ep_overlap_on_delay_wgrad"]
    assert not (tmp_path / "ab.json").exists()


def test_gb200_hybridep_uses_nvl72_domain(tmp_path, capsys):
    rc, script, err = dry_run(tmp_path, capsys, "-g", "gb200", "-ng", "16", "-ep", "16",
                              "--moe_flex_dispatcher_backend", "hybridep", "--moe_a2a_overlap", "true")
    assert rc == 0, err
    d = directives(script)
    assert (d["nodes"], d["ntasks-per-node"], d["gpus-per-node"]) == ("4", "4", "4")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=32" in script
    assert "export NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=16" in script


def test_cpu_job_has_no_gpu_directive_and_runs_the_worker(tmp_path, capsys):
    rc, script, err = dry_run(tmp_path, capsys, "-g", "cpu", "-ng", "2", "--executor", "slurm", "--max_steps", "3",
                              "--repeats", "2", "--ab", "ep_overlap", "--profile")
    assert rc == 0, err
    d = directives(script)
    assert "gpus-per-node" not in d and "exclusive" not in d
    assert (d["nodes"], d["ntasks"]) == ("1", "2")
    assert "mbridge_epoverlap.runtime.worker" in script and "--max-steps 3" in script
    assert "megatron.bridge" not in script
    runs = re.findall(r"^run_case (\S+) (\S+) (\d+)", script, re.M)
    assert [(n, r) for n, r, _ in runs][:6] == [("ep_overlap_off", "1"), ("ep_overlap_on", "1"),
                                               ("ep_overlap_on_delay_wgrad", "1"), ("ep_overlap_off", "2"),
                                               ("ep_overlap_on", "2"), ("ep_overlap_on_delay_wgrad", "2")]
    assert [r for _, r, _ in runs][6:] == ["profile"] * 3 and "--profile-dir" in script
    assert [i for _, _, i in runs] == [str(i) for i in range(9)]  # one port per run
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_last_error_line(tmp_path):
    log = tmp_path / "slurm-1.out"
    log.write_text("[mbridge-epoverlap] case a repeat 1: start\nTraceback (most recent call last):\n  File x\n"
                   "RuntimeError: rank 1 exited with status 3\nsrun: error: vm: task 1: Exited with exit code 3\n")
    assert last_error_line(log) == "srun: error: vm: task 1: Exited with exit code 3"
    assert last_error_line(tmp_path / "missing") is None


def test_enable_nsys_profiles_every_case_over_the_profiling_steps(tmp_path, capsys):
    """-en (Megatron-Bridge's flag): each case gets a run under nsys, over --profiling_start_step..stop_step."""
    rc, script, err = dry_run(tmp_path, capsys, "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "--te_version",
                              "2.12", "--ab", "ep_overlap", "-en", "--profiling_start_step", "3",
                              "--profiling_stop_step", "5")
    assert rc == 0, err
    profiled = [line for line in script.splitlines() if line.startswith("run_case") and " profile " in line]
    assert len(profiled) == 3 and all(line.endswith("--profile-window 3:5") for line in profiled)
    assert "PROFILER=(nsys profile" in script


def test_profile_window_is_clipped_to_the_run():
    from types import SimpleNamespace

    from mbridge_epoverlap.harness.job_options import profile_window

    args = SimpleNamespace(enable_nsys=True, pytorch_profiler=False, profiling_start_step=10, profiling_stop_step=11)
    assert profile_window(args, 10) == "10:10"
    assert profile_window(args, 5) is None  # starts after the run: the stable window is profiled instead
    assert profile_window(SimpleNamespace(enable_nsys=False, pytorch_profiler=False), 10) is None


def test_the_job_changes_only_the_flags_and_the_case_settings(tmp_path, capsys):
    """Issue #23 item 0: the job starts from Megatron-Bridge's recipe; the dry run lists every field it changes."""
    rc, script, err = dry_run(tmp_path, capsys, "-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16",
                              "-gn", "8", "--te_version", "2.12", "--ab", "ep_overlap", "-ep", "8")
    assert rc == 0, err
    lines = script.splitlines()
    every = next(line for line in lines if line.startswith("#   every case: train.train_iters="))
    assert "logger.log_interval=1" in every
    off = next(line for line in lines if line.startswith("#   case ep_overlap_off:"))
    assert "model.expert_model_parallel_size=8" in off and "comm_overlap.overlap_moe_expert_parallel_comm=False" in off
    assert "moe_token_dispatcher_type" not in off and "moe_permute_fusion" not in off  # the recipe's stay
    job_dir = tmp_path / "ab.slurm"
    changes = json.loads((job_dir / "configs" / "ep_overlap_on.changes.json").read_text())
    assert changes["comm_overlap.overlap_moe_expert_parallel_comm"] is True
    assert "model.num_layers" not in changes and "ddp.grad_reduce_in_fp32" not in changes
    assert f"--changes {job_dir / 'configs' / 'ep_overlap_on.changes.json'}" in script


def test_nsys_extra_args_replace_the_default_of_the_same_option(tmp_path, capsys):
    """--nsys_extra_args and --nsys_trace reach the profiled runs' nsys; one naming a default option replaces it
    (nsys refuses an option given twice; Megatron-Bridge main merges the same way since #4669)."""
    from mbridge_epoverlap.harness.executors.slurm_script import nsys_options

    assert nsys_options(["--trace=cuda,nvtx,osrt", "--cuda-graph-trace=node"]) == [
        "--trace=cuda,nvtx,osrt", "--cuda-graph-trace=node", "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop", "--force-overwrite=true"]
    rc, script, err = dry_run(tmp_path, capsys, "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "--te_version",
                              "2.12", "-en", "--nsys_extra_args=--capture-range-end=repeat,--sample=none",
                              "--nsys_trace", "cuda,nvtx,cublas")
    assert rc == 0, err
    (line,) = [line for line in script.splitlines() if "PROFILER=(nsys profile" in line]
    assert line.count("--capture-range-end=") == 1 and "--capture-range-end=repeat" in line, line
    assert line.count("--trace=") == 1 and "--trace=cuda,nvtx,cublas" in line and "--sample=none" in line, line
    rc, _script, err = dry_run(tmp_path, capsys, "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "--te_version",
                               "2.12", "-en", "--nsys_extra_args=-o,/tmp/mine")
    assert rc == 2 and "-o/--output is the harness's" in err, err
