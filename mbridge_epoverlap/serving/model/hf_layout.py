"""Where each weight of a Hugging Face MoE checkpoint lives, and its expected shape.

The serving modules store the query, key and value projections as one matrix, and each SwiGLU's gate and
up projections as one (gate rows first), as `moe.attention` and `moe.experts` do; a `Source` lists the
checkpoint tensors that are concatenated (along dim 0) into one parameter, or the row ranges of them it takes
(one expert of a tensor holding every expert, DBRX's) and whether the result is transposed
(`CheckpointReader.read` reads it so). The names themselves are each architecture's
(`serving.model.architectures`); this module looks up the spec's.
"""

from __future__ import annotations

from mbridge_epoverlap.serving.model import architectures
from mbridge_epoverlap.serving.model.architectures.base import Source
from mbridge_epoverlap.serving.model.spec import ModelSpec

ARCHITECTURES = architectures.NAMES

__all__ = ["ARCHITECTURES", "Source", "all_sources", "attention_sources", "expert_sources"]


def attention_sources(spec: ModelSpec) -> dict[str, Source]:
    """Parameter name of `serving.model.parts.AttentionPart` -> its checkpoint tensors."""
    return architectures.get(spec.architecture).attention_sources(spec)


def expert_sources(spec: ModelSpec, layer: int, expert: int) -> tuple[Source, Source]:
    """(gate and up projections -> `w1[e]` [2*ffn, hidden], down projection -> `w2[e]` [hidden, ffn])."""
    return architectures.get(spec.architecture).expert_sources(spec, layer, expert)


def all_sources(spec: ModelSpec) -> list[Source]:
    """Every tensor the model reads, attention part first, then experts by layer and id."""
    arch = architectures.get(spec.architecture)
    sources = list(arch.attention_sources(spec).values())
    for layer in spec.moe_layer_ids:
        for e in range(spec.num_experts):
            sources.extend(arch.expert_sources(spec, layer, e))
    return sources
