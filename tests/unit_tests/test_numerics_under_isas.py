"""`scripts/numerics_under_isas.py`: the profiles, what each holds the libraries to, and its bad input."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_epoverlap.machine import cpu_flags, cpu_vendor

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "numerics_under_isas.py"


def _script():
    spec = importlib.util.spec_from_file_location("numerics_under_isas", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["numerics_under_isas"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_an_unknown_profile_exits_2_naming_the_known_ones():
    done = subprocess.run([sys.executable, str(SCRIPT), "--profiles", "avx2-only,avx9000"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "avx9000" in done.stderr and "mkl-avx512" in done.stderr and "Traceback" not in done.stderr


def test_list_names_every_profile_and_the_cpu():
    done = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CPU: ")
    for name in ("as-is", "mkl-avx512", "mkl-avx2+onednn-bf16", "avx2-only"):
        assert name in done.stdout
    assert "ATEN_CPU_CAPABILITY=avx2" in done.stdout


def test_the_avx2_profile_holds_aten_and_mkl_to_avx2(tmp_path):
    """The probe runs torch under the profile: ATen's dispatch and MKL's code path say AVX2."""
    module = _script()
    if "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    profile = next(p for p in module.PROFILES if p.name == "avx2-only")
    shim = module.build_mkl_intel_path(tmp_path) if cpu_vendor() != "GenuineIntel" else None
    isas = module.probe_isas(module.profile_env(profile, shim))
    assert "ATen: AVX2" in isas and "AVX2" in isas.split(";")[0], isas
    assert "oneDNN: Intel AVX2" in isas, isas  # the probe reaches oneDNN, not only its cap


def test_a_profile_whose_libraries_ran_already_is_not_run_again():
    """`--after-as-is`: the libraries as they are ran in the main run; the as-is profile reports the same
    ISAs, so it is skipped with that reason rather than run (`-k` would select nothing if it ran)."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--after-as-is", "--profiles", "as-is", "--",
                           "-k", "no_test_has_this_name"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| as-is | skipped: the same libraries as as-is (the main run) |" in done.stdout, done.stdout


def test_the_mkl_avx512_profile_runs_intel_kernels_on_any_vendor(tmp_path):
    """On an AMD CPU MKL ignores its instruction switch and runs its generic kernels; the preloaded vendor
    answer gives it the AVX-512 kernels an Intel machine runs."""
    module = _script()
    if "avx512f" not in cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    profile = next(p for p in module.PROFILES if p.name == "mkl-avx512")
    shim = module.build_mkl_intel_path(tmp_path)
    mkl = module.probe_isas(module.profile_env(profile, shim)).split(";")[0]
    assert "AVX-512" in mkl, mkl
