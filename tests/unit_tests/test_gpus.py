"""One catalog of GPU facts for the validator, the harness, the launch environment and the planner."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.config.environment import GPU_CATALOG, Environment
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.gpus import GPU_FACTS, GPUS, gpu_facts
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.serving.planning.catalog import GPUS as PLANNER_GPUS
from mbridge_epoverlap.serving.planning.catalog import get_gpu


@pytest.mark.parametrize(("name", "key"), [("h100", "h100"), ("H100", "h100"), ("A100-80G", "a100"),
                                           ("a100", "a100"), ("GB200", "gb200"), ("vr200", "vr200")])
def test_both_spellings_name_one_entry(name, key):
    assert gpu_facts(name) is GPU_FACTS[key]
    assert Environment.for_gpu(name).gpu_name == Environment.for_gpu(key).gpu_name


def test_every_consumer_reads_the_same_catalog():
    assert GPU_CATALOG is GPU_FACTS
    assert set(GPUS) == {"cpu", *GPU_FACTS}
    for name, gpu in PLANNER_GPUS.items():
        assert GPU_FACTS[gpu.key] is gpu and gpu.name == name
    assert get_gpu("h100") is get_gpu("H100") is GPU_FACTS["h100"]


def test_harness_accepts_the_display_spelling():
    assert build_parser().parse_args(["-g", "H100"]).gpu == "h100"


def test_unknown_gpu_names_the_setting_and_a_close_match():
    with pytest.raises(UsageError, match=r"unknown GPU 'h1000' for --gpu \(did you mean h100\?\)"):
        gpu_facts("h1000")
