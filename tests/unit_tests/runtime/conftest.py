"""Shared helpers of the runtime tests: tiny CPU-sized configs."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.shrink import CpuShape
from mbridge_epoverlap.recipes.cpu_case import cpu_overlap_case

TINY = CpuShape(num_layers=2, hidden_size=32, num_attention_heads=4, expert_ffn_hidden_size=16, seq_length=16,
                vocab_size=64, micro_batch_size=1, num_micro_batches=3, max_topk=2,
                force_balanced_routing=False)


def tiny_config(procs: int, *, overlap: bool = False, delay: bool = False, recipe: str = "qwen3_30b_a3b",
                fp32: bool = False) -> RunConfig:
    """A finalized, tiny run of `recipe` on `procs` CPU processes (EP = procs)."""
    cfg = cpu_overlap_case(recipe, procs, overlap=overlap, delay_wgrad=delay, shape=TINY)
    if fp32:
        cfg.env_vars["MBRIDGE_EPOVERLAP_DTYPE"] = "fp32"
    return cfg


@pytest.fixture(scope="session")
def make_tiny():
    return tiny_config
