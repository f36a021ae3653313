"""The CPU runtime's dtype: fp32 unless the CPU has native bf16 or the user asks for bf16.

The CPU flags are injected through `MBRIDGE_EPOVERLAP_CPU_FLAGS`, so both branches run on any machine.
"""

from __future__ import annotations

import pytest

from mbridge_epoverlap.config.cpu_precision import choose_cpu_precision
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.harness.resolve import resolve
from mbridge_epoverlap.machine import CPU_FLAGS_ENV, cpu_flags, machine
from mbridge_epoverlap.runtime.options import RuntimeOptions

AVX2_ONLY = "fpu sse2 avx avx2 fma"
AMX = "fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile"
DTYPE = "MBRIDGE_EPOVERLAP_DTYPE"


def resolved(monkeypatch, flags: str, *argv: str):
    monkeypatch.setenv(CPU_FLAGS_ENV, flags)
    args = build_parser().parse_intermixed_args(["-g", "cpu", "-ng", "2", *argv])
    return resolve(args)


def test_flags_come_from_cpuinfo_or_the_override(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2 amx_bf16\n")
    assert cpu_flags({}, str(info)) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags({CPU_FLAGS_ENV: "avx2,fma"}, str(info)) == {"avx2", "fma"}
    assert cpu_flags({}, str(tmp_path / "absent")) == frozenset()


def test_choice_for_each_cpu_and_request():
    slow = choose_cpu_precision(True, flags=AVX2_ONLY.split())
    assert (slow.dtype, slow.native_bf16, slow.cpu_flags, slow.warning) == ("fp32", False, ("avx2",), None)
    assert "no native bf16" in slow.reason and "-c bf16" in slow.reason
    fast = choose_cpu_precision(True, flags=AMX.split())
    assert (fast.dtype, fast.native_bf16) == ("bf16", True) and "amx_bf16" in fast.reason
    assert fast.cpu_flags == ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    forced = choose_cpu_precision(True, requested="bf16", flags=AVX2_ONLY.split())
    assert forced.dtype == "bf16" and "9x slower" in (forced.warning or "")
    assert choose_cpu_precision(True, requested="bf16", flags=AMX.split()).warning is None
    assert choose_cpu_precision(True, requested="fp16", flags=AMX.split()).dtype == "bf16"
    assert choose_cpu_precision(True, requested="fp32", flags=AMX.split()).dtype == "fp32"
    assert choose_cpu_precision(False, flags=AMX.split()).dtype == "fp32"


def test_harness_hands_the_choice_to_the_ranks(monkeypatch):
    slow = resolved(monkeypatch, AVX2_ONLY)
    assert slow.cfg.model.bf16  # the config keeps the recipe's precision (EP overlap rules need it)
    assert slow.cfg.env_vars[DTYPE] == "fp32" and slow.cpu_precision.dtype == "fp32"
    assert any("computes in fp32" in note for note in slow.notes)
    assert RuntimeOptions.from_env(slow.cfg.env_vars).dtype == "fp32"
    fast = resolved(monkeypatch, AMX)
    assert fast.cfg.env_vars[DTYPE] == "bf16" and fast.cpu_precision.warning is None
    forced = resolved(monkeypatch, AVX2_ONLY, "-c", "bf16")
    assert forced.cfg.env_vars[DTYPE] == "bf16" and "slower" in forced.cpu_precision.warning
    by_variable = resolved(monkeypatch, AVX2_ONLY, "env_vars.MBRIDGE_EPOVERLAP_DTYPE=bf16")
    assert by_variable.cfg.env_vars[DTYPE] == "bf16" and by_variable.cpu_precision.warning
    with pytest.raises(UsageError, match="MBRIDGE_EPOVERLAP_DTYPE"):
        resolved(monkeypatch, AVX2_ONLY, "env_vars.MBRIDGE_EPOVERLAP_DTYPE=fp8")


def test_machine_record_names_the_flags(monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, AVX2_ONLY)
    info = machine()
    assert info["cpu_flags"] == ["avx2"] and info["native_bf16"] is False and info["cpu"]
    monkeypatch.setenv(CPU_FLAGS_ENV, AMX)
    assert machine()["native_bf16"] is True


def test_runtime_alone_makes_the_same_choice(monkeypatch):
    import torch

    from mbridge_epoverlap.runtime.train import resolve_dtype
    from tests.unit_tests.runtime.conftest import tiny_config

    cfg = tiny_config(1)
    cpu = torch.device("cpu")
    monkeypatch.setenv(CPU_FLAGS_ENV, AVX2_ONLY)
    assert resolve_dtype(cfg, RuntimeOptions(), cpu) == torch.float32
    assert resolve_dtype(cfg, RuntimeOptions(dtype="bf16"), cpu) == torch.bfloat16
    monkeypatch.setenv(CPU_FLAGS_ENV, AMX)
    assert resolve_dtype(cfg, RuntimeOptions(), cpu) == torch.bfloat16
    assert resolve_dtype(cfg, RuntimeOptions(dtype="fp32"), cpu) == torch.float32
