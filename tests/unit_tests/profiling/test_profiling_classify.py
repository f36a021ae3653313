"""Name rules: DeepEP/HybridEP count as communication, memory ops as neither."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.profiling.classify import (
    COMBINE_RANGE,
    COMM,
    COMPUTE,
    DISPATCH_RANGE,
    MEMORY,
    Classifier,
    step_number,
)


@pytest.mark.parametrize(
    "name",
    [
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
        "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*)",
        "deep_ep::internode_ll::combine",
        "void hybrid_ep::dispatch_kernel<bf16>(void*)",
        "HYBRID_EP_combine",
        "dpsk::ep::low_latency_dispatch",
        "gloo:all_to_all",
        "void at::native::(anonymous namespace)::nccl_copy<float>()",
    ],
)
def test_communication_names(name):
    assert Classifier().kind(name) == COMM


@pytest.mark.parametrize(
    "name",
    [
        "sm90_xmma_gemm_bf16bf16_bf16f32",
        "void at::native::vectorized_elementwise_kernel<4>(int)",
        "my_ncclish_gemm",  # library names only at a name or namespace boundary
        "dispatch",  # DeepEP's shortName alone is not enough; the demangled name carries deep_ep::
        "flash_fwd_kernel",
    ],
)
def test_compute_names(name):
    assert Classifier().kind(name) == COMPUTE


@pytest.mark.parametrize("name", ["Memcpy HtoD (Pinned -> Device)", "Memset (Device)", "dma_copy", "MEMCPY DtoD"])
def test_memory_names(name):
    assert Classifier().kind(name) == MEMORY


def test_user_regex_adds_to_builtin_names():
    c = Classifier(r"my_a2a|alltoallv")
    assert c.kind("void my_a2a_kernel()") == COMM
    assert c.kind("AllToAllV_fused") == COMM  # case-insensitive
    assert c.kind("ncclDevKernel_SendRecv") == COMM
    assert "my_a2a" in c.describe()


def test_bad_user_regex_is_a_usage_error():
    with pytest.raises(UsageError, match=r"--comm-regex 'a\(b'.*not a valid regular expression"):
        Classifier("a(b")


def test_range_names():
    assert DISPATCH_RANGE.search("moe_dispatch_fwd") and COMBINE_RANGE.search("F1.Combine")
    assert not DISPATCH_RANGE.search("pre_dispatch") and not DISPATCH_RANGE.search("pre-dispatch")
    assert step_number("ProfilerStep#12") == 12
    assert step_number("iteration 3") == 3 and step_number("Iteration_4") == 4 and step_number("step 7") == 7
    assert step_number("optimizer step") is None and step_number("ProfilerStep") is None
