"""Which dtype the CPU reference runtime computes in, and why.

A recipe's bf16 is a GPU setting. On a CPU, bf16 GEMMs are fast only with native bf16 instructions
(`avx512_bf16` or `amx_bf16`); on an AVX2-only CPU torch emulates them and a bf16 GEMM is about 9x slower
than fp32, which turns a one-second training step into ten. So `-g cpu` computes in fp32 unless the CPU
has native bf16 or the user asked for bf16 explicitly (`-c bf16`), and says which and why.

The CPU's flags come from `mbridge_epoverlap.machine.cpu_flags` (/proc/cpuinfo, or
`MBRIDGE_EPOVERLAP_CPU_FLAGS`, so tests and users can try either branch on any machine). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from mbridge_epoverlap.machine import NATIVE_BF16_FLAGS, REPORTED_FLAGS, cpu_flags, has_native_bf16, reported_flags


@dataclass(frozen=True)
class CpuPrecision:
    """The CPU runtime's compute dtype and the reason for it.

    Attributes:
        dtype: "fp32" or "bf16" (the value of `MBRIDGE_EPOVERLAP_DTYPE` the ranks get).
        reason: one sentence for the output and the results JSON.
        native_bf16: whether the CPU has `avx512_bf16` or `amx_bf16`.
        cpu_flags: the GEMM-relevant flags the choice was made with.
        warning: set when the choice will be slow (explicit bf16 without native bf16).
    """

    dtype: str
    reason: str
    native_bf16: bool
    cpu_flags: tuple[str, ...]
    warning: str | None = None

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["cpu_flags"] = list(self.cpu_flags)
        return data


def choose_cpu_precision(recipe_low_precision: bool, *, requested: str | None = None,
                         flags: Iterable[str] | None = None, origin: str = "the recipe's", flag: str = "-c",
                         spelling: Mapping[str, str] | None = None) -> CpuPrecision:
    """Pick the CPU compute dtype.

    Args:
        recipe_low_precision: the config asks for bf16 or fp16 (the recipe's GPU precision).
        requested: the dtype the user asked for explicitly ("bf16", "fp16" or "fp32", e.g. `-c bf16`), or
            None when it comes from the recipe.
        flags: the CPU's feature flags (`cpu_flags()` if None).
        origin, flag, spelling: how the reasons name where the low precision comes from ("the recipe's"), the
            option that forces a dtype ("-c") and that option's value for each dtype (default: "bf16", "fp32");
            serving says "the checkpoint's", "--dtype" and "bfloat16", so both commands explain their choice
            with the same rule and the same words.
    """
    flags = cpu_flags() if flags is None else frozenset(flags)
    native = has_native_bf16(flags)
    shown = tuple(reported_flags(flags))
    flag_text = " ".join(shown) or "none of " + "/".join(REPORTED_FLAGS)

    def option(dtype: str) -> str:
        return f"{flag} {(spelling or {}).get(dtype, dtype)}"

    if requested == "fp32" or (requested is None and not recipe_low_precision):
        why = f"asked for with {option('fp32')}" if requested == "fp32" else "the config's precision"
        return CpuPrecision("fp32", f"fp32: {why}", native, shown)
    if requested is not None:  # explicit bf16 or fp16 (fp16 runs as bf16 on the CPU runtime)
        warning = None if native else (
            f"{option(requested)} on a CPU without native bf16 (flags: {flag_text}): bf16 GEMMs are emulated "
            f"there and run about 9x slower than fp32; drop {flag} to compute in fp32")
        return CpuPrecision("bf16", f"bf16: asked for with {option(requested)}", native, shown, warning)
    if native:
        have = " and ".join(f for f in NATIVE_BF16_FLAGS if f in flags)
        return CpuPrecision("bf16", f"bf16: {origin} precision, and this CPU has native bf16 ({have})",
                            native, shown)
    return CpuPrecision("fp32", f"fp32 instead of {origin} bf16: this CPU has no native bf16 (flags: "
                                f"{flag_text}; no {' or '.join(NATIVE_BF16_FLAGS)}), where bf16 GEMMs run about 9x "
                                f"slower; {option('bf16')} forces bf16", native, shown)
