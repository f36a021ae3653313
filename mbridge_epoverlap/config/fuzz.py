"""Random EP-overlap configs and their comparison with a Megatron-Core release's `TransformerConfig`.

The differential test (installed release) and `benchmarks/mcore_release_fuzz.py` (every release from its
source tree) share this: `random_config` draws `TransformerConfig` keyword arguments that keep every
non-overlap setting valid, `mcore_verdict` builds the real object, and `compare` says whether the
validator and Megatron-Core agree. Only the rules a release's `TransformerConfig` itself enforces
(`Rule.enforced_by_core`) are compared: Megatron-Bridge's extra checks and the layer-build check reject
configurations `TransformerConfig` accepts, by design.
"""

from __future__ import annotations

import logging
import random
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# Assertion texts of Megatron-Core's overlap checks (and the TypeError its TE version probe raises when
# Transformer Engine is absent, which is how it rejects delayed wgrad with TE graphs without TE).
OVERLAP_REJECTIONS = (
    "overlap_moe_expert_parallel_comm",
    "A2A Overlap",
    "EP A2A overlap",
    "delay_wgrad_compute",
    "MTP layernum",
    "MTP supports at most one layer",
    "CUDA graph scope on moe and mlp",
    "Invalid cuda graph implementation",
    "legacy groupedgemm",
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


def random_config(rng: random.Random, release: tuple[int, int], torch_dtype: Any) -> dict[str, Any]:
    """`TransformerConfig` keyword arguments for one random overlap config valid for `release` (major, minor)."""
    granularity, method, num_layers, modules = rng.choice(RECOMPUTE)
    shared = rng.choice([None, 64])
    pp, vpp = rng.choice([(1, None), (2, None), (2, 2)])
    impls = ["none", "none", "local", "transformer_engine", "transformer_engine"]
    if release >= (0, 18):
        impls.append("full_iteration")
    elif rng.random() < 0.05:
        impls.append("full_iteration")  # unknown before 0.18: the validator must say so too
    impl = "none" if granularity == "full" else rng.choice(impls)
    if impl == "transformer_engine":
        scope = list(rng.choice(TE_SCOPES))
    elif impl == "local":
        scope = list(rng.choice([[], ["full_iteration"]])) if release < (0, 18) else []
    else:
        scope = []
    if modules == ["moe"] and "moe_router" in scope:
        scope = ["attn"]  # core rejects moe recompute inside a router graph for reasons unrelated to overlap
    dispatcher = rng.choice(["allgather", "alltoall", "alltoall", "flex"])
    if ("moe" in scope or "mlp" in scope) and dispatcher == "flex":
        dispatcher = "alltoall"
    bf16, fp16 = rng.choice([(True, False), (False, True), (False, False)])
    mtp_choices = [None, None, 1, 2] + ([0] if release >= (0, 19) else [])
    kw: dict[str, Any] = dict(
        num_layers=8, hidden_size=64, num_attention_heads=4, num_moe_experts=rng.choice([4, 8]),
        moe_ffn_hidden_size=64, moe_grouped_gemm=True, pipeline_dtype=torch_dtype,
        attention_dropout=0.0, hidden_dropout=0.0,
        overlap_moe_expert_parallel_comm=rng.random() < 0.7, delay_wgrad_compute=rng.random() < 0.5,
        expert_model_parallel_size=rng.choice([1, 2, 4]), moe_token_dispatcher_type=dispatcher,
        bf16=bf16, fp16=fp16, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        recompute_granularity=granularity, recompute_method=method, recompute_num_layers=num_layers,
        recompute_modules=modules, moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_overlap=bool(shared) and dispatcher == "alltoall" and rng.random() < 0.5,
        mtp_num_layers=rng.choice(mtp_choices), cuda_graph_impl=impl,
        gradient_accumulation_fusion=rng.random() < 0.3, add_bias_linear=rng.random() < 0.5,
        add_qkv_bias=rng.random() < 0.3,
    )
    if release < (0, 17):  # the field was removed in 0.17
        kw["moe_use_legacy_grouped_gemm"] = rng.random() < 0.1
    if release < (0, 16) and impl != "none":  # 0.15 rejects any CUDA graph with recompute, unrelated to overlap
        kw.update(recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                  recompute_modules=None)
    # From 0.18 the scope may be written in either field (core migrates the old one); before, only the old.
    if release >= (0, 18) and scope and rng.random() < 0.5:
        kw["cuda_graph_modules"] = scope
    else:
        kw["cuda_graph_scope"] = scope or "full"
    if "moe" in scope or "mlp" in scope:
        kw.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    if release >= (0, 16) and rng.random() < 0.1:
        kw["ep_overlap_early_attn_memory_release"] = True
    return kw


def mcore_verdict(config_class: type, kwargs: dict[str, Any]) -> tuple[str | None, Any]:
    """(None, the object) when `TransformerConfig(**kwargs)` accepts, else (the rejection text, None)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            return None, config_class(**dict(kwargs))
        except (AssertionError, ValueError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}", None
        finally:
            logging.disable(previous)


def is_overlap_rejection(rejection: str) -> bool:
    return any(text in rejection for text in OVERLAP_REJECTIONS)


@dataclass
class Tally:
    """Counts of one comparison run."""

    accepted: int = 0
    overlap_rejected: int = 0
    other_rejected: int = 0
    missed: int = 0  # core rejected for an overlap rule; the validator found no core-enforced error
    false: int = 0  # the validator found a core-enforced error; core accepted
    false_on_object: int = 0  # the validator, reading the accepted real object, found a core-enforced error


def core_errors(model: Any, env: Any) -> list[str]:
    """Ids of the validator's errors that the environment's Megatron-Core release itself enforces."""
    from mbridge_epoverlap.config import CommOverlapConfig
    from mbridge_epoverlap.config.rules import all_rules
    from mbridge_epoverlap.config.versions import core_rules
    from mbridge_epoverlap.config.violations import errors_of

    core = core_rules(env.mcore_version)
    enforced = {r.id for r in all_rules() if r.enforced_by_core(core)}
    # TransformerConfig takes the switches as they are; in Megatron-Bridge terms, they are set in comm_overlap.
    overlap = bool(getattr(model, "overlap_moe_expert_parallel_comm", False))
    switches = CommOverlapConfig(overlap_moe_expert_parallel_comm=overlap,
                                 delay_wgrad_compute=bool(getattr(model, "delay_wgrad_compute", False)))
    return [v.rule for v in errors_of(switches.validate(model, env=env)) if v.rule in enforced]


def compare(config_class: type, env: Any, samples: int, seed: int, torch_dtype: Any,
            examples: list[str] | None = None) -> Tally:
    """Draw `samples` configs, build each with `config_class`, and count agreements and disagreements."""
    from mbridge_epoverlap.config.versions import core_rules

    release = core_rules(env.mcore_version).minor
    rng = random.Random(seed)
    tally = Tally()
    for index in range(samples):
        kwargs = random_config(rng, release, torch_dtype)
        rejection, built = mcore_verdict(config_class, kwargs)
        errors = core_errors(SimpleNamespace(**kwargs), env)
        if rejection is None:
            tally.accepted += 1
            if errors:
                tally.false += 1
                _note(examples, f"false #{index}: validator {errors}; core accepts {kwargs}")
            on_object = core_errors(built, env)
            if on_object:
                tally.false_on_object += 1
                _note(examples, f"false on object #{index}: validator {on_object}; {kwargs}")
        elif is_overlap_rejection(rejection):
            tally.overlap_rejected += 1
            if not errors:
                tally.missed += 1
                _note(examples, f"missed #{index}: core says {rejection[:160]!r}; {kwargs}")
        else:
            tally.other_rejected += 1
            if tally.other_rejected <= 3:
                _note(examples, f"other #{index}: core says {rejection[:300]!r}")
    return tally


def _note(examples: list[str] | None, text: str) -> None:
    if examples is not None and len(examples) < 20:
        examples.append(text)
