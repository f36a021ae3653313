"""The software and hardware a job will run with: versions and the GPU.

`Environment.detect()` reads this machine; `Environment.for_gpu("h100", te_version="2.9")` describes a
cluster job from anywhere, so a config can be validated before it is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import metadata

from packaging.version import InvalidVersion, Version

from mbridge_epoverlap.errors import UsageError


@dataclass(frozen=True)
class GpuSpec:
    """Catalog entry: the CUDA device name and compute capability of a GPU family."""

    key: str
    device_name: str
    compute_capability: tuple[int, int]
    nvlink_domain: int  # GPUs per NVLink domain in the usual system (NVL72 racks for GB200/GB300)


# Device names as torch.cuda.get_device_name reports them; capabilities from NVIDIA's CUDA GPU list.
GPU_CATALOG: dict[str, GpuSpec] = {
    spec.key: spec
    for spec in (
        GpuSpec("a100", "NVIDIA A100-SXM4-80GB", (8, 0), 8),
        GpuSpec("h100", "NVIDIA H100 80GB HBM3", (9, 0), 8),
        GpuSpec("h200", "NVIDIA H200", (9, 0), 8),
        GpuSpec("h20", "NVIDIA H20", (9, 0), 8),
        GpuSpec("l40s", "NVIDIA L40S", (8, 9), 1),
        GpuSpec("b200", "NVIDIA B200", (10, 0), 8),
        GpuSpec("b300", "NVIDIA B300 SXM6 AC", (10, 3), 8),
        GpuSpec("gb200", "NVIDIA GB200", (10, 0), 72),
        GpuSpec("gb300", "NVIDIA GB300", (10, 3), 72),
    )
}


def parse_version(value: str | None, setting: str) -> str | None:
    """Normalise a version string, or raise UsageError naming the setting."""
    if value is None:
        return None
    try:
        return str(Version(str(value).strip()))
    except InvalidVersion:
        raise UsageError(f"{setting}: {value!r} is not a version; use a form like 2.9.0") from None


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Environment:
    """Versions and GPU a config is checked against.

    Attributes:
        torch_version: PyTorch version; None means unknown (the torch rule is then not checked).
        te_version: Transformer Engine version; None means Transformer Engine is not installed.
        mcore_version: Megatron-Core version whose rules apply; None means the newest rules.
        gpu_name: CUDA device name (e.g. "NVIDIA H100 80GB HBM3"); None means no GPU is known.
        compute_capability: (major, minor); None means no GPU is known.
    """

    torch_version: str | None = None
    te_version: str | None = None
    mcore_version: str | None = None
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("torch_version", "te_version", "mcore_version"):
            object.__setattr__(self, name, parse_version(getattr(self, name), name))
        if self.compute_capability is not None:
            object.__setattr__(self, "compute_capability", tuple(int(x) for x in self.compute_capability))

    @classmethod
    def detect(cls) -> Environment:
        """Read the running machine: installed torch, Transformer Engine, Megatron-Core, first GPU."""
        torch_version = _installed("torch")
        if torch_version is not None:
            torch_version = torch_version.split("+")[0]
        te_version = _installed("transformer-engine") or _installed("transformer_engine")
        mcore_version = _installed("megatron-core") or _installed("megatron_core")
        gpu_name = capability = None
        try:
            import torch

            if torch.cuda.is_available():
                gpu_name = torch.cuda.get_device_name(0)
                capability = tuple(torch.cuda.get_device_capability(0))
        except Exception:  # a broken CUDA setup means "no GPU known", not a crash
            gpu_name = capability = None
        return cls(torch_version, te_version, mcore_version, gpu_name, capability)

    @classmethod
    def for_gpu(cls, name: str, **versions: str | None) -> Environment:
        """An environment for a GPU family from the catalog (a100, h100, h200, h20, l40s, b200, ...)."""
        spec = gpu_spec(name)
        unknown = set(versions) - {"torch_version", "te_version", "mcore_version"}
        if unknown:
            raise UsageError(f"Environment.for_gpu: unknown setting(s) {sorted(unknown)}; "
                             "use torch_version, te_version, mcore_version")
        return cls(gpu_name=spec.device_name, compute_capability=spec.compute_capability, **versions)

    def with_versions(self, **versions: str | None) -> Environment:
        """A copy with the given versions replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in versions.items() if v is not None})

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None or self.compute_capability is not None

    def describe(self) -> str:
        gpu = self.gpu_name or "no GPU"
        te = self.te_version or "not installed"
        core = self.mcore_version or "newest"
        return f"GPU {gpu}; torch {self.torch_version or 'unknown'}; TE {te}; Megatron-Core rules {core}"

    def to_dict(self) -> dict[str, object]:
        return {
            "torch_version": self.torch_version,
            "te_version": self.te_version,
            "mcore_version": self.mcore_version,
            "gpu_name": self.gpu_name,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
        }


def gpu_spec(name: str) -> GpuSpec:
    key = name.strip().lower()
    if key not in GPU_CATALOG:
        raise UsageError(f"unknown GPU {name!r}; known: {', '.join(GPU_CATALOG)}")
    return GPU_CATALOG[key]


def version_at_least(version: str | None, minimum: str) -> bool:
    """True when `version` is known and >= `minimum` (pre-release and local tags count as the release)."""
    if version is None:
        return False
    return Version(version).release >= Version(minimum).release
