"""`--dtype auto` (the default): the checkpoint's dtype where this CPU computes it natively, float32 otherwise.

The CPU flags are injected through `MBRIDGE_EPOVERLAP_CPU_FLAGS`, so both outcomes run on any machine.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.machine import CPU_FLAGS_ENV
from mbridge_epoverlap.serving.engine.choice.dtype import checkpoint_dtype, choose_serving_dtype, parse_dtype
from tests.unit_tests.cli_runner import REPO

AVX2_ONLY = "fpu sse2 avx avx2 fma"
AMX = "fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile"


def _saved_as(source: Path, target: Path, dtype: str, *, config_field: str | None = "dtype") -> Path:
    """A copy of checkpoint `source` with its tensors stored in `dtype` and config.json saying so in
    `config_field` (None: no dtype field, as an old or hand-written config)."""
    import torch
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in load_file(path).items()}
            save_file(tensors, target / path.name, metadata={"format": "pt"})
        elif path.name != "config.json":
            shutil.copy(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    for name in ("dtype", "torch_dtype"):
        config.pop(name, None)
    if config_field is not None:
        config[config_field] = dtype
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def bf16_dir(tiny_mixtral_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_as(tiny_mixtral_dir, tmp_path_factory.mktemp("bf16") / "ckpt", "bfloat16")


def test_the_checkpoint_s_dtype_is_read_from_its_config_or_its_tensors(tiny_mixtral_dir, bf16_dir, tmp_path):
    assert checkpoint_dtype(tiny_mixtral_dir) == ("float32", "config.json dtype")  # transformers 5.x saves `dtype`
    assert checkpoint_dtype(bf16_dir) == ("bfloat16", "config.json dtype")
    old = _saved_as(tiny_mixtral_dir, tmp_path / "old", "float16", config_field="torch_dtype")
    assert checkpoint_dtype(old) == ("float16", "config.json torch_dtype")
    bare = _saved_as(tiny_mixtral_dir, tmp_path / "bare", "bfloat16", config_field=None)
    assert checkpoint_dtype(bare) == ("bfloat16", "safetensors tensors")
    assert checkpoint_dtype(tmp_path / "absent") == (None, None)


def test_auto_follows_the_checkpoint_where_the_cpu_computes_it_natively(tiny_mixtral_dir, bf16_dir, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, AMX)
    fast = choose_serving_dtype("auto", bf16_dir)
    assert (fast.dtype, fast.native_bf16, fast.warning) == ("bfloat16", True, None)
    assert "checkpoint's precision" in fast.reason and "amx_bf16" in fast.reason
    monkeypatch.setenv(CPU_FLAGS_ENV, AVX2_ONLY)
    slow = choose_serving_dtype("auto", bf16_dir)
    assert (slow.dtype, slow.native_bf16, slow.checkpoint_dtype) == ("float32", False, "bfloat16")
    assert "no native bf16" in slow.reason and "9x slower" in slow.reason and "--dtype bfloat16" in slow.reason
    for flags in (AMX, AVX2_ONLY):  # float32 checkpoints (the test fixtures), float16 ones and recipes: float32
        monkeypatch.setenv(CPU_FLAGS_ENV, flags)
        assert choose_serving_dtype("auto", tiny_mixtral_dir).dtype == "float32"
        half = choose_serving_dtype("auto", _saved_as(tiny_mixtral_dir, tmp_path / f"half{len(flags)}", "float16"))
        assert half.dtype == "float32" and "float16" in half.reason and "exactly" in half.reason
        recipe = choose_serving_dtype("auto", "qwen3_30b_a3b")
        assert recipe.dtype == "float32" and "recipe" in recipe.reason and recipe.checkpoint_dtype is None


def test_an_explicit_dtype_wins_and_bf16_without_native_bf16_warns(tiny_mixtral_dir, bf16_dir, monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, AMX)
    assert choose_serving_dtype("float32", bf16_dir).dtype == "float32"
    assert choose_serving_dtype("bfloat16", tiny_mixtral_dir).dtype == "bfloat16"
    monkeypatch.setenv(CPU_FLAGS_ENV, AVX2_ONLY)
    forced = choose_serving_dtype("bfloat16", bf16_dir)
    assert forced.dtype == "bfloat16" and forced.reason == "bf16: asked for with --dtype bfloat16"
    assert "9x slower" in (forced.warning or "") and "drop --dtype" in (forced.warning or "")


def test_a_dtype_the_workers_cannot_compute_in_is_refused_naming_the_fix(tiny_mixtral_dir):
    from tests.unit_tests.cli_runner import run_cli

    with pytest.raises(UsageError, match="float32 holds|holds every float16"):
        parse_dtype("float16")
    with pytest.raises(UsageError, match="write --dtype bfloat16"):
        parse_dtype("bf16")
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--http", "127.0.0.1:0", "--dtype", "float16")
    assert done.returncode == 2 and "--dtype float16" in done.stderr and "--dtype float32" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("flags", "expected"), [(AMX, "bfloat16"), (AVX2_ONLY, "float32")], ids=["amx", "avx2"])
def test_serve_json_says_the_dtype_it_computed_in_and_why(bf16_dir, tmp_path, flags, expected):
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": [5, 6, 7]}) + "\n")
    # The flags are faked; where oneDNN cannot pack bf16 on the real CPU (it needs avx512bw/vl/dq, which every CPU
    # with avx512_bf16 or amx_bf16 has), the workers run unpacked GEMMs (`serving.model.packed.available`).
    env = dict(os.environ, PYTHONPATH=str(REPO), **{CPU_FLAGS_ENV: flags})
    done = subprocess.run([sys.executable, "-m", "mbridge_epoverlap.cli", "serve", "--checkpoint", str(bf16_dir),
                           "--prompts", str(prompts), "--max-new-tokens", "3", "--colocated", "1", "--json"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["dtype"]["dtype"] == expected and result["dtype"]["requested"] == "auto"
    assert result["dtype"]["checkpoint_dtype"] == "bfloat16"
    assert f"dtype {expected} (" in done.stderr
    assert len(result["completions"][0]["output_ids"]) == 3
