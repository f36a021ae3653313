"""Differential test with the installed Megatron-Core's real `TransformerConfig` as the oracle.

For a few hundred randomized overlap configs (`mbridge_epoverlap.config.fuzz`), build a real
`TransformerConfig` (megatron-core is installed by the project). Wherever it rejects a config for an
overlap rule, the validator (checking for the installed core version) reports an error among the rules
that release enforces; wherever the validator reports such an error, `TransformerConfig` rejects; and
an accepted real object, read back by the validator, passes. `benchmarks/mcore_release_fuzz.py` runs the
same comparison against every release 0.15-0.20 from their source trees.
"""

from __future__ import annotations

from importlib import metadata

import torch

from tests.unit_tests.requirements import import_or_skip

transformer_config = import_or_skip("megatron.core.transformer.transformer_config", "megatron_core")

from mbridge_epoverlap.config import Environment  # noqa: E402
from mbridge_epoverlap.config.fuzz import compare  # noqa: E402

SAMPLES = 300


def test_validator_agrees_with_megatron_core():
    env = Environment(torch_version=metadata.version("torch").split("+")[0], te_version=None,
                      mcore_version=metadata.version("megatron-core"))
    examples: list[str] = []
    tally = compare(transformer_config.TransformerConfig, env, SAMPLES, 20261129, torch.bfloat16, examples)
    assert (tally.missed, tally.false, tally.false_on_object) == (0, 0, 0), "\n".join(examples)
    # The generator must exercise both sides, or the test proves nothing.
    assert tally.accepted >= SAMPLES // 10, tally
    assert tally.overlap_rejected >= SAMPLES // 3, tally
    assert tally.other_rejected <= SAMPLES // 20, tally
