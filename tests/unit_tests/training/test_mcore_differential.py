"""Differential test with Megatron-Core as the oracle.

For a few hundred randomized overlap configs, build a real `TransformerConfig` (megatron-core is
installed by the project). Wherever it rejects a config for an overlap rule, the validator (checking
for the installed core version) reports an error; wherever the validator reports no error,
`TransformerConfig` accepts. The generator keeps every non-overlap setting valid so that any
rejection is about overlap.
"""

from __future__ import annotations

import logging
import random
import warnings
from importlib import metadata
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")

from mbridge_epoverlap.config import CommOverlapConfig, Environment  # noqa: E402
from mbridge_epoverlap.config.violations import errors_of  # noqa: E402

SAMPLES = 300

# Assertion texts of Megatron-Core's overlap checks (and the TypeError its TE version probe raises
# when Transformer Engine is absent, which is how it rejects delayed wgrad with TE graphs here).
OVERLAP_REJECTIONS = (
    "overlap_moe_expert_parallel_comm",
    "A2A Overlap",
    "EP A2A overlap",
    "delay_wgrad_compute",
    "MTP layernum",
    "'>=' not supported between instances of 'NoneType' and 'Version'",
)

RECOMPUTE = [
    (None, None, None, None),
    ("selective", None, None, None),
    ("selective", None, None, ["moe"]),
    ("selective", None, None, ["moe_act"]),
    ("full", "uniform", 1, None),
    ("full", "block", 1, None),
]
TE_SCOPES = [[], ["attn"], ["moe_router"], ["moe_router", "moe_preprocess"], ["attn", "moe_router"], ["moe"],
             ["attn", "moe"]]


def random_config(rng: random.Random) -> dict:
    granularity, method, num_layers, modules = rng.choice(RECOMPUTE)
    shared = rng.choice([None, 64])
    pp, vpp = rng.choice([(1, None), (2, None), (2, 2)])
    impl = "none" if granularity == "full" else rng.choice(["none", "none", "local", "transformer_engine"])
    if impl == "transformer_engine":
        scope = list(rng.choice(TE_SCOPES))
    elif impl == "local":
        scope = list(rng.choice([[], ["full_iteration"]]))
    else:
        scope = []
    if modules == ["moe"] and "moe_router" in scope:
        scope = ["attn"]  # core rejects moe recompute inside a router graph for reasons unrelated to overlap
    dispatcher = rng.choice(["allgather", "alltoall", "alltoall", "flex"])
    if "moe" in scope and dispatcher == "flex":
        dispatcher = "alltoall"
    bf16, fp16 = rng.choice([(True, False), (False, True), (False, False)])
    kw = dict(
        num_layers=8, hidden_size=64, num_attention_heads=4, num_moe_experts=rng.choice([4, 8]),
        moe_ffn_hidden_size=64, moe_grouped_gemm=True, pipeline_dtype=torch.bfloat16,
        attention_dropout=0.0, hidden_dropout=0.0,
        overlap_moe_expert_parallel_comm=rng.random() < 0.7, delay_wgrad_compute=rng.random() < 0.5,
        expert_model_parallel_size=rng.choice([1, 2, 4]), moe_token_dispatcher_type=dispatcher,
        bf16=bf16, fp16=fp16, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        recompute_granularity=granularity, recompute_method=method, recompute_num_layers=num_layers,
        recompute_modules=modules, moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_overlap=bool(shared) and dispatcher == "alltoall" and rng.random() < 0.5,
        mtp_num_layers=rng.choice([None, None, 1, 2]), cuda_graph_impl=impl, cuda_graph_scope=scope or "full",
        gradient_accumulation_fusion=rng.random() < 0.3, add_bias_linear=rng.random() < 0.5,
        add_qkv_bias=rng.random() < 0.3, moe_use_legacy_grouped_gemm=rng.random() < 0.1,
    )
    if "moe" in scope:
        kw.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    return kw


def mcore_verdict(kwargs: dict) -> str | None:
    """None when TransformerConfig accepts, else the rejection text."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            transformer_config.TransformerConfig(**dict(kwargs))
        except (AssertionError, ValueError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            logging.disable(previous)
    return None


def test_validator_agrees_with_megatron_core():
    env = Environment(torch_version=metadata.version("torch").split("+")[0], te_version=None,
                      mcore_version=metadata.version("megatron-core"))
    rng = random.Random(20261129)
    counts = {"accepted": 0, "overlap_rejected": 0, "other_rejected": 0}
    for index in range(SAMPLES):
        kwargs = random_config(rng)
        rejection = mcore_verdict(kwargs)
        errors = errors_of(CommOverlapConfig().validate(SimpleNamespace(**kwargs), env=env))
        context = f"sample {index}: {kwargs}\nMegatron-Core: {rejection}\nvalidator errors: {[e.rule for e in errors]}"
        if rejection is None:
            counts["accepted"] += 1
        elif any(text in rejection for text in OVERLAP_REJECTIONS):
            counts["overlap_rejected"] += 1
            assert errors, "Megatron-Core rejected for an overlap rule but the validator found no error\n" + context
        else:
            counts["other_rejected"] += 1
        if not errors:
            assert rejection is None, "validator found no error but Megatron-Core rejected\n" + context
    print(counts)
    # The generator must exercise both sides, or the test proves nothing.
    assert counts["accepted"] >= SAMPLES // 10, counts
    assert counts["overlap_rejected"] >= SAMPLES // 3, counts
    assert counts["other_rejected"] <= SAMPLES // 20, counts
