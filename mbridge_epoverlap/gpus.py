"""One catalog of GPU facts, used by the validator, the harness, the launch environment and the planner.

Each entry has a lowercase key as the perf harness spells targets (`-g h100`, Megatron-Bridge's
spelling) and a display name as the serving planner spells them (`--attn-gpu H100`); `gpu_facts` accepts
either, in any case. Sources:

- device names as `torch.cuda.get_device_name` reports them and compute capabilities from NVIDIA's CUDA
  GPU list (None where this catalog does not know it);
- NVLink domain, HybridEP topology and `CUDA_DEVICE_MAX_CONNECTIONS` class as Megatron-Bridge's
  `scripts/performance` sets them per target (8-GPU domains without multi-node NVLink on H100/B200/B300;
  72-GPU NVL72 domains with MNNVL on GB200/GB300/VR200/R100; 32 connections on Blackwell and VR200);
- serving figures (dense bf16 tensor FLOP/s, HBM, NIC, scale-up link) from vendor datasheets, and
  relative prices (only good for ratios), for the GPUs the planner models. H20 = 1.85 and L40S = 1.08
  are MegaScale-Infer's normalized per-chip prices (Table 3 of the paper); the others are rough ratios
  of 2025 public on-demand cloud rates against those two, not quotes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from mbridge_epoverlap.errors import UsageError


@dataclass(frozen=True)
class GpuFacts:
    """One accelerator type.

    Attributes:
        key: harness spelling (`-g` value), lowercase.
        name: display name (serving planner spelling).
        device_name: CUDA device name prefix, or None when not known here.
        compute_capability: (major, minor), or None when not known here.
        nvlink_domain: GPUs in one NVLink domain of the usual system (1 without NVLink).
        use_mnnvl: the NVLink domain spans nodes (NVL72 racks).
        many_connections: Megatron-Bridge launches with CUDA_DEVICE_MAX_CONNECTIONS=32 on this target.
        gpus_per_node: GPUs per node of the usual system.
        tflops_bf16: dense bf16 tensor throughput, TFLOP/s (None: not modelled by the planner).
        hbm_tbs: memory bandwidth, TB/s.
        hbm_gb: memory capacity, GB (10^9 bytes).
        nic_gbps: scale-out network bandwidth per GPU, Gbit/s.
        scale_up_gbs: scale-up bandwidth per GPU, GB/s, aggregate over both directions.
        scale_up: "nvlink" or "pcie".
        price: relative price per GPU-hour.
    """

    key: str
    name: str
    device_name: str | None
    compute_capability: tuple[int, int] | None
    nvlink_domain: int
    use_mnnvl: bool = False
    many_connections: bool = False
    gpus_per_node: int = 8
    tflops_bf16: float | None = None
    hbm_tbs: float | None = None
    hbm_gb: float | None = None
    nic_gbps: float | None = None
    scale_up_gbs: float | None = None
    scale_up: str = "nvlink"
    price: float | None = None

    @property
    def modelled(self) -> bool:
        """Whether the serving figures are known (the planner can use this GPU)."""
        return self.tflops_bf16 is not None

    @property
    def flops(self) -> float:
        return self.tflops_bf16 * 1e12

    @property
    def mem_bw(self) -> float:
        """bytes/s"""
        return self.hbm_tbs * 1e12

    @property
    def mem_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def nic_bw(self) -> float:
        """bytes/s, one direction"""
        return self.nic_gbps * 1e9 / 8

    @property
    def scale_up_bw(self) -> float:
        """bytes/s, one direction (half the aggregate)"""
        return self.scale_up_gbs * 1e9 / 2


GPU_FACTS: dict[str, GpuFacts] = {
    g.key: g
    for g in (
        # A100 80GB SXM: 312 TFLOPS bf16 dense, 2,039 GB/s, NVLink 600 GB/s; DGX A100 8x 200 Gb/s.
        GpuFacts("a100", "A100-80G", "NVIDIA A100-SXM4-80GB", (8, 0), 8,
                 tflops_bf16=312, hbm_tbs=2.039, hbm_gb=80, nic_gbps=200, scale_up_gbs=600, price=1.6),
        # H100 SXM: 989 TFLOPS bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; DGX H100 8x 400 Gb/s.
        GpuFacts("h100", "H100", "NVIDIA H100 80GB HBM3", (9, 0), 8,
                 tflops_bf16=989, hbm_tbs=3.35, hbm_gb=80, nic_gbps=400, scale_up_gbs=900, price=2.9),
        # H200 SXM: 989 TFLOPS bf16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
        GpuFacts("h200", "H200", "NVIDIA H200", (9, 0), 8,
                 tflops_bf16=989, hbm_tbs=4.8, hbm_gb=141, nic_gbps=400, scale_up_gbs=900, price=3.5),
        # H20: 148 TFLOPS bf16, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s; one 400 Gb/s NIC per GPU.
        GpuFacts("h20", "H20", "NVIDIA H20", (9, 0), 8,
                 tflops_bf16=148, hbm_tbs=4.0, hbm_gb=96, nic_gbps=400, scale_up_gbs=900, price=1.85),
        # L40S: 362 TFLOPS bf16 dense, 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16, no NVLink.
        GpuFacts("l40s", "L40S", "NVIDIA L40S", (8, 9), 1,
                 tflops_bf16=362, hbm_tbs=0.864, hbm_gb=48, nic_gbps=200, scale_up_gbs=64, scale_up="pcie",
                 price=1.08),
        # HGX/DGX B200: 2.25 PFLOPS bf16 dense, 180 GB HBM3e, 8 TB/s, NVLink 5 1.8 TB/s; 8x 400 Gb/s.
        GpuFacts("b200", "B200", "NVIDIA B200", (10, 0), 8, many_connections=True,
                 tflops_bf16=2250, hbm_tbs=8.0, hbm_gb=180, nic_gbps=400, scale_up_gbs=1800, price=5.0),
        # HGX B300: 2.25 PFLOPS bf16 dense, 288 GB HBM3e, 8 TB/s, NVLink 5 1.8 TB/s; ConnectX-8 800 Gb/s.
        GpuFacts("b300", "B300", "NVIDIA B300 SXM6 AC", (10, 3), 8, many_connections=True,
                 tflops_bf16=2250, hbm_tbs=8.0, hbm_gb=288, nic_gbps=800, scale_up_gbs=1800, price=6.0),
        # GB200 NVL72 (per GPU = rack / 72): 2.5 PFLOPS bf16 dense, 186 GB HBM3e, 8 TB/s, NVLink 5 1.8 TB/s.
        GpuFacts("gb200", "GB200", "NVIDIA GB200", (10, 0), 72, use_mnnvl=True, many_connections=True,
                 gpus_per_node=4, tflops_bf16=2500, hbm_tbs=8.0, hbm_gb=186, nic_gbps=400, scale_up_gbs=1800,
                 price=6.5),
        GpuFacts("gb300", "GB300", "NVIDIA GB300", (10, 3), 72, use_mnnvl=True, many_connections=True,
                 gpus_per_node=4),
        # Rubin targets of Megatron-Bridge's perf scripts: NVL72-style domains; device facts not known here.
        GpuFacts("vr200", "VR200", None, None, 72, use_mnnvl=True, many_connections=True, gpus_per_node=4),
        GpuFacts("r100", "R100", None, None, 72, use_mnnvl=True, gpus_per_node=1),
    )
}


# The targets `-g/--gpu` accepts (`validate`, the perf harness): the catalog's keys, plus `cpu` for the
# reference runtime on this machine; -g H100 works too (lowercased).
GPUS = ("cpu", *GPU_FACTS)


def gpu_facts(name: str, *, setting: str = "--gpu") -> GpuFacts:
    """The catalog entry for `name`: a key (`h100`) or a display name (`H100`, `A100-80G`), any case.

    Raises:
        UsageError: unknown name; the message names the setting and lists the known GPUs.
    """
    wanted = str(name).strip().casefold()
    for facts in GPU_FACTS.values():
        if wanted in (facts.key, facts.name.casefold()):
            return facts
    known = [f.key for f in GPU_FACTS.values()]
    close = difflib.get_close_matches(wanted, known, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UsageError(f"unknown GPU {name!r} for {setting}{hint}; known: {', '.join(known)}")
