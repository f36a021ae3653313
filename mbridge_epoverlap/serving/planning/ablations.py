"""MegaScale-Infer's ablations replayed through the planner, each beside the paper's figure.

The paper (arXiv 2504.02263; the figures as `../shared/REFERENCE.md` sections 4 and 5 summarise them) measured on
GPUs what this module asks of the performance model (`perf_model`) and the search (`search`):

- `micro_batches`: the ping-pong pipeline's gain with m = 1..4 micro-batches, per model (Mixtral 8x22B, DBRX,
  Scaled-MoE): paper m 1 -> 2 about 1.9x, m 2 -> 3 a further 1.10-1.38x.
- `attention_replicas`: DBRX with its attention data-parallel degree swept 1..16 at one layout (attention TP 1, one
  expert per GPU, m = 3): the paper's per-GPU throughput peaks near 8 replicas.
- `heterogeneous`: H20 attention with L40S experts against homogeneous deployments, throughput per cost: the paper
  3.24x over vLLM and 1.86x over TensorRT-LLM, both colocated on H20.
- `disaggregation`: the best disaggregated deployment over the best colocated one on one GPU kind, per GPU: the
  paper up to 4.66x over its colocated baselines.

Each `Finding` carries the planner's figure, the paper's (a value or a range), whether they agree within
`TOLERANCE`, and for a disagreement what the two compare that differs (`EXPLANATIONS`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.planning.search import best_colocated, best_disaggregated

PAPER_MODELS = ("Mixtral-8x22B", "DBRX", "Scaled-MoE")
TOLERANCE = 0.25
DEFAULT_GPU = "A100-80G"

EXPLANATIONS = {
    "heterogeneous": (
        "the paper divides by vLLM's and TensorRT-LLM's measured colocated throughput on H20; the planner's colocated "
        "baseline is the roofline of colocated expert parallelism at its best TP and EP group count, under the same "
        "SLO and kernels as the disaggregated side, so it credits the baselines with efficiency they did not reach"),
    "disaggregation": (
        "the paper's colocated figure is its baselines' (TP-sharded experts, all-to-all without overlap, their "
        "kernels); the planner's colocated side is ideal EP with the same kernels as the disaggregated side, which "
        "keeps up with disaggregation for the 8- and 16-expert models: what remains is the ping-pong overlap and "
        "the expert GEMMs' batch, not the baselines' implementation gaps"),
    "attention_replicas": (
        "the peak is the replica count at which the experts' time per micro-batch overtakes attention's; it moves "
        "with the GPU's compute over its memory bandwidth, and the paper's 8 is for its GPU (8 on the A100-80G, the "
        "default here)"),
}


@dataclass(frozen=True)
class Finding:
    """One figure of one ablation: the planner's, the paper's range [low, high], and whether they agree."""

    experiment: str
    case: str
    planner: float
    paper_low: float
    paper_high: float
    unit: str

    @property
    def within(self) -> bool:
        """Inside the paper's range widened by `TOLERANCE` on each side."""
        return self.paper_low * (1 - TOLERANCE) <= self.planner <= self.paper_high * (1 + TOLERANCE)

    @property
    def inside(self) -> bool:
        """Inside the paper's range itself."""
        return self.paper_low <= self.planner <= self.paper_high

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["within"] = self.within
        # said wherever the figure leaves the paper's own range (within the tolerance or not) and the experiment
        # has a known reason; `benchmarks/paper_ablations.py` names any figure past the tolerance without one
        out["explanation"] = None if self.inside else EXPLANATIONS.get(self.experiment)
        return out


def micro_batches(gpu: str = DEFAULT_GPU) -> tuple[list[Finding], dict[str, dict[int, float]]]:
    """Per model, the best deployment's per-GPU throughput at each fixed m, and the m 1 -> 2 and 2 -> 3 gains."""
    findings, curves = [], {}
    for model in PAPER_MODELS:
        curve = {m: best_disaggregated(model, gpu, m=m).throughput_per_gpu for m in (1, 2, 3, 4)}
        curves[model] = curve
        findings.append(Finding("micro_batches", f"{model} m 1->2", curve[2] / curve[1], 1.9, 1.9, "x"))
        findings.append(Finding("micro_batches", f"{model} m 2->3", curve[3] / curve[2], 1.10, 1.38, "x"))
    return findings, curves


def attention_replicas(gpu: str = DEFAULT_GPU) -> tuple[list[Finding], dict[int, float]]:
    """DBRX's per-GPU throughput with 1..16 attention replicas (attention TP 1, one expert per GPU, m = 3), and
    the replica count where it peaks."""
    curve = {}
    for n_a in range(1, 17):
        try:
            curve[n_a] = best_disaggregated("DBRX", gpu, n_a=n_a, m=3, tp_a=1, tp_e=1,
                                            experts_per_group=1).throughput_per_gpu
        except UsageError:  # a replica count the SLO or memory rules out
            continue
    peak = max(curve, key=lambda n: curve[n])
    return [Finding("attention_replicas", "DBRX peak replicas", float(peak), 8, 8, "replicas")], curve


def heterogeneous() -> tuple[list[Finding], dict[str, dict[str, float]]]:
    """Throughput per cost of H20 attention with L40S experts over colocated H20 (the paper's baselines' hardware)
    and over homogeneous disaggregated H20 and L40S deployments."""
    findings, table = [], {}
    for model in PAPER_MODELS:
        mixed = best_disaggregated(model, "H20", "L40S").throughput_per_cost
        row = {"h20_colocated": best_colocated(model, "H20").throughput_per_cost,
               "h20_disaggregated": best_disaggregated(model, "H20").throughput_per_cost,
               "l40s_disaggregated": best_disaggregated(model, "L40S").throughput_per_cost}
        table[model] = {"h20_l40s": mixed, **row}
        findings.append(Finding("heterogeneous", f"{model} H20+L40S over colocated H20",
                                mixed / row["h20_colocated"], 1.86, 3.24, "x per cost"))
    return findings, table


def disaggregation(gpu: str = DEFAULT_GPU) -> tuple[list[Finding], dict[str, dict[str, float]]]:
    """Per model, the best disaggregated deployment's per-GPU throughput over the best colocated one's."""
    findings, table = [], {}
    for model in PAPER_MODELS:
        apart = best_disaggregated(model, gpu).throughput_per_gpu
        together = best_colocated(model, gpu).throughput_per_gpu
        table[model] = {"disaggregated": apart, "colocated": together}
        # "up to 4.66x": the paper's largest gain; any gain above 1 up to it is within its range
        findings.append(Finding("disaggregation", f"{model} on {gpu}", apart / together, 1.0, 4.66, "x per GPU"))
    return findings, table


def run(gpu: str = DEFAULT_GPU) -> dict[str, Any]:
    """Every ablation: its findings (with explanations where outside the paper's range) and the curves behind
    them."""
    mb, mb_curves = micro_batches(gpu)
    dp, dp_curve = attention_replicas(gpu)
    het, het_table = heterogeneous()
    dis, dis_table = disaggregation(gpu)
    findings = mb + dp + het + dis
    return {"gpu": gpu, "tolerance": TOLERANCE, "findings": [f.to_dict() for f in findings],
            "curves": {"micro_batches": mb_curves, "attention_replicas": dp_curve, "heterogeneous": het_table,
                       "disaggregation": dis_table}}
