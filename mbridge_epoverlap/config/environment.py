"""The software and hardware a job will run with: versions and the GPU.

`Environment.detect()` reads this machine; `Environment.for_gpu("h100", te_version="2.9")` describes a
cluster job from anywhere, so a config can be validated before it is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import metadata

from packaging.version import InvalidVersion, Version

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.gpus import GPU_FACTS, GpuFacts, gpu_facts

# The harness's GPU targets with their device facts (one catalog for the whole project).
GPU_CATALOG: dict[str, GpuFacts] = GPU_FACTS


def parse_version(value: str | None, setting: str) -> str | None:
    """Normalise a version string, or raise UsageError naming the setting."""
    if value is None:
        return None
    try:
        return str(Version(str(value).strip()))
    except InvalidVersion:
        raise UsageError(f"{setting}: {value!r} is not a version; use a form like 2.9.0") from None


def parse_bridge_version(value: str | None, setting: str) -> str | None:
    """A Megatron-Bridge version: "main" (the main branch) or a release, normalised like `parse_version`."""
    if value is not None and str(value).strip().lower() == "main":
        return "main"
    return parse_version(value, setting)


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
        bridge_version: Megatron-Bridge release whose behaviour applies ("main" for the main branch);
            None means the newest release.
        gpu_name: CUDA device name (e.g. "NVIDIA H100 80GB HBM3"); None means no GPU is known.
        compute_capability: (major, minor); None means no GPU is known.
        gpu_probe_error: why probing this machine's GPU failed (CUDA present but broken); None when the
            probe worked or was not run. A failed probe is never read as "no GPU".
    """

    torch_version: str | None = None
    te_version: str | None = None
    mcore_version: str | None = None
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    gpu_probe_error: str | None = None
    bridge_version: str | None = None

    def __post_init__(self) -> None:
        for name in ("torch_version", "te_version", "mcore_version"):
            object.__setattr__(self, name, parse_version(getattr(self, name), name))
        object.__setattr__(self, "bridge_version", parse_bridge_version(self.bridge_version, "bridge_version"))
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
        from mbridge_epoverlap.config.versions import installed_bridge_release

        bridge_version = installed_bridge_release()  # main's development version (0.7.0) reads as "main"
        gpu_name, capability, probe_error = _probe_gpu()
        return cls(torch_version, te_version, mcore_version, gpu_name, capability, probe_error, bridge_version)

    @classmethod
    def for_gpu(cls, name: str, **versions: str | None) -> Environment:
        """An environment for a GPU family from the catalog (a100, h100, h200, h20, l40s, b200, ...)."""
        spec = gpu_spec(name)
        unknown = set(versions) - {"torch_version", "te_version", "mcore_version", "bridge_version"}
        if unknown:
            raise UsageError(f"Environment.for_gpu: unknown setting(s) {sorted(unknown)}; "
                             "use torch_version, te_version, mcore_version, bridge_version")
        # A target whose device name is not known here still counts as a GPU (its backends are then unsupported).
        return cls(gpu_name=spec.device_name or f"NVIDIA {spec.name}", compute_capability=spec.compute_capability,
                   **versions)

    def with_versions(self, **versions: str | None) -> Environment:
        """A copy with the given versions replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in versions.items() if v is not None})

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None or self.compute_capability is not None

    def require_gpu_probe(self) -> None:
        """Raise `GpuProbeError` when this machine's GPU probe failed (so nothing treats it as absent)."""
        if self.gpu_probe_error is not None:
            raise GpuProbeError(self.gpu_probe_error)

    def describe(self) -> str:
        gpu = self.gpu_name or ("GPU probe failed" if self.gpu_probe_error else "no GPU")
        te = self.te_version or "not installed"
        core = self.mcore_version or "newest"
        bridge = self.bridge_version or "newest release"
        return (f"GPU {gpu}; torch {self.torch_version or 'unknown'}; TE {te}; Megatron-Core rules {core}; "
                f"Megatron-Bridge {bridge}")

    def to_dict(self) -> dict[str, object]:
        return {
            "torch_version": self.torch_version,
            "te_version": self.te_version,
            "mcore_version": self.mcore_version,
            "gpu_name": self.gpu_name,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "gpu_probe_error": self.gpu_probe_error,
            "bridge_version": self.bridge_version,
        }


class GpuProbeError(RuntimeError):
    """CUDA is present but probing the GPU failed; the message names the probe and the fix."""


def _probe_gpu() -> tuple[str | None, tuple[int, int] | None, str | None]:
    """(device name, capability, probe error) of GPU 0; no torch or no CUDA means (None, None, None)."""
    try:
        import torch
    except ImportError:
        return None, None, None
    try:
        if not torch.cuda.is_available():
            return None, None, None
        return torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0)), None
    except Exception as exc:  # noqa: BLE001 - any CUDA failure is reported, with its type and text
        return None, None, (f"the CUDA probe (torch.cuda.get_device_name/get_device_capability of GPU 0) failed: "
                            f"{type(exc).__name__}: {exc}; fix the CUDA setup (driver, CUDA_VISIBLE_DEVICES), or "
                            "name the target GPU explicitly (-g/--gpu)")


def gpu_spec(name: str) -> GpuFacts:
    """The catalog entry of a GPU target (either spelling: `h100` or `H100`)."""
    return gpu_facts(name)


def version_at_least(version: str | None, minimum: str) -> bool:
    """True when `version` is known and >= `minimum` (pre-release and local tags count as the release)."""
    if version is None:
        return False
    # Versions compare as releases (2.12 == 2.12.0; release tuples of different lengths do not).
    return Version(Version(version).base_version) >= Version(Version(minimum).base_version)
