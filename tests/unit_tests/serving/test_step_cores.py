"""A worker process with several cores (`workers.step_cores.StepCores`): narrow steps on one torch thread with the
experts' tiled GEMMs on every core, wide steps on torch's threads, torch on every core where the experts do not
tile; and an engine run on one such process gives the tokens of one thread."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kernels import small_gemm
from mbridge_epoverlap.serving.workers.step_cores import WIDE_TOKENS, StepCores, experts_tile


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    small_gemm.set_threads(1)


@pytest.mark.skipif(not small_gemm.available(), reason=f"{small_gemm.unavailable_reason()}")
def test_narrow_steps_split_the_tiled_gemms_and_wide_ones_run_on_torchs_threads(threads_restored) -> None:
    cores = StepCores(2, tiles=True)
    cores.for_step(10)
    assert torch.get_num_threads() == 1 and small_gemm.threads() == 2
    cores.for_step(WIDE_TOKENS)
    assert torch.get_num_threads() == 2 and small_gemm.threads() == 1
    cores.for_step(WIDE_TOKENS - 1)
    assert torch.get_num_threads() == 1 and small_gemm.threads() == 2
    assert "tiled expert GEMMs" in cores.summary


def test_without_tiles_or_with_one_core_the_threads_stay_as_given(threads_restored) -> None:
    cores = StepCores(2, tiles=False)
    for tokens in (1, WIDE_TOKENS, 5):
        cores.for_step(tokens)
        assert torch.get_num_threads() == 2 and small_gemm.threads() == 1
    assert cores.summary == "torch on 2 threads"
    torch.set_num_threads(1)
    single = StepCores(1, tiles=True)
    single.for_step(1)
    assert torch.get_num_threads() == 1 and small_gemm.threads() == 1 and single.summary == "one thread"


def test_experts_tile_in_fp32_on_whole_tiles_only(tiny_mixtral_dir) -> None:
    spec = load_spec(tiny_mixtral_dir, dtype="float32")
    fits = small_gemm.fits(2 * spec.expert_ffn) and small_gemm.fits(spec.hidden_size)
    assert experts_tile(spec) == (fits and small_gemm.available())
    assert not experts_tile(load_spec(tiny_mixtral_dir, dtype="bfloat16"))


@pytest.mark.skipif(not small_gemm.available(), reason=f"{small_gemm.unavailable_reason()}")
def test_lent_cores_split_the_narrow_steps_until_they_are_taken_back(threads_restored) -> None:
    torch.set_num_threads(1)
    cores = StepCores(1, tiles=True)
    cores.use(2)  # an idle process's core lent to this one
    cores.for_step(10)
    assert torch.get_num_threads() == 1 and small_gemm.threads() == 2
    cores.use(1)  # taken back: the helpers stand down before the next step
    cores.for_step(10)
    assert torch.get_num_threads() == 1 and small_gemm.threads() == 1 and cores.summary == "one thread"
