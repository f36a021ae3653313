"""The tiled GEMMs of a few rows (`small_gemm`): the bits of its torch twin on every CPU, a row's result whatever
rows share its call, only the groups' rows written, the experts of a decode step routed to it, and oneDNN where
it cannot be built (no compiler, a compile error, switched off)."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.moe.experts import grouped_expert_swiglu
from mbridge_epoverlap.serving.model import packed
from mbridge_epoverlap.serving.model.kernels import build, small_gemm

needs_library = pytest.mark.skipif(not small_gemm.available(), reason=f"{small_gemm.unavailable_reason()}")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_library
@pytest.mark.numerics
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9])
def test_the_tiled_gemm_is_its_torch_twin_bit_for_bit(rows):
    """Each output is a product then a sum per k, in order, no fused multiply-add: the bits `reference_tiled_gemm`
    computes with torch's elementwise ops, so the same on every CPU and vector width."""
    weight, x = _rand(96, 80, seed=0) * 0.1, _rand(rows, 80, seed=1)
    out = torch.full((rows, 96), float("nan"))
    small_gemm.grouped(x, [(0, rows)], [small_gemm.tiled(weight)], out)
    assert torch.equal(out, small_gemm.reference_tiled_gemm(x, weight))
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)


@needs_library
@pytest.mark.numerics
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    weight, x = _rand(64, 48, seed=2), _rand(7, 48, seed=3)
    tiles = small_gemm.tiled(weight)
    together = torch.empty(7, 64)
    small_gemm.grouped(x, [(0, 7)], [tiles], together)
    for row in range(7):
        alone = torch.empty(1, 64)
        small_gemm.grouped(x[row:row + 1].clone(), [(0, 1)], [tiles], alone)
        assert torch.equal(alone[0], together[row])


@needs_library
def test_a_grouped_call_writes_each_groups_rows_with_its_own_weight_and_nothing_else():
    weights = [_rand(32, 40, seed=10 + i) for i in range(3)]
    x = _rand(9, 40, seed=4)
    groups = [(0, 2), (4, 1), (6, 3)]  # rows 2-3 and 5 belong to no group
    out = torch.full((9, 32), float("nan"))
    small_gemm.grouped(x, groups, [small_gemm.tiled(w) for w in weights], out)
    for (start, n), w in zip(groups, weights, strict=True):
        torch.testing.assert_close(out[start:start + n], x[start:start + n] @ w.T, rtol=1e-5, atol=1e-5)
    assert out[[2, 3, 5]].isnan().all()


def test_a_weight_tiles_only_in_fp32_whole_tiles():
    assert small_gemm.tiled(torch.zeros(64, 8)).shape == (2, 8, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        small_gemm.tiled(torch.zeros(48, 8))
    with pytest.raises(ValueError, match="fp32"):
        small_gemm.tiled(torch.zeros(64, 8, dtype=torch.bfloat16))


@needs_library
@pytest.mark.skipif(not packed.available(torch.float32), reason="this torch has no oneDNN linear ops")
@pytest.mark.parametrize("counts", [[1, 0, 4, 9, 2, 5], [1, 1, 1, 1, 1, 1], [6, 0, 0, 300, 1, 3]])
def test_experts_of_a_few_rows_take_the_tiled_gemm_and_all_equal_the_reference(one_thread, monkeypatch, counts):
    """Experts of up to `SMALL_ROWS` rows run in one tiled call (the others on oneDNN): the same results to fp32
    rounding, and the tiled experts' bits are those of the tiled GEMM (it is what ran)."""
    g = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(6, 96, 64, generator=g) * 0.05, torch.randn(6, 64, 48, generator=g) * 0.05
    x = torch.randn(sum(counts), 64, generator=g)
    experts = packed.PackedExperts(w1, w2)
    assert experts.tiles
    got = experts.swiglu(x, counts)
    torch.testing.assert_close(got, grouped_expert_swiglu(x, w1, w2, counts), rtol=1e-5, atol=1e-6)
    start = sum(counts[:4])  # expert 4: 1 or 2 rows, tiled
    rows = x[start:start + counts[4]]
    gate, up = small_gemm.reference_tiled_gemm(rows, w1[4]).chunk(2, dim=-1)
    assert torch.equal(got[start:start + counts[4]],
                       small_gemm.reference_tiled_gemm(torch.nn.functional.silu(gate) * up, w2[4]))
    monkeypatch.setattr(packed, "PER_EXPERT_ROWS", 1)  # the prefill path routes the same experts the same way
    monkeypatch.setattr(packed, "EACH_ROWS_PER_EXPERT", 1)
    assert torch.equal(experts.swiglu(x, counts), got)


@needs_library
def test_an_elastic_repack_reuses_a_holders_tiles_and_tiles_where_the_holder_has_none():
    g = torch.Generator().manual_seed(6)
    w1, w2 = torch.randn(3, 64, 32, generator=g), torch.randn(3, 32, 32, generator=g)
    holder, layer = packed.PackedExperts(w1, w2), packed.PackedExperts(w1.clone(), w2.clone())
    held = holder.packed_of(1)
    layer.refresh({1: held, 2: packed.PackedExpert(held.up, held.down)})
    assert layer.packed_of(1) is held
    assert torch.equal(layer.packed_of(2).up_tiles, small_gemm.tiled(w1[2]))


def test_switched_off_the_experts_run_on_onednn(monkeypatch):
    monkeypatch.setenv("MBRIDGE_EPOVERLAP_SMALL_GEMM", "0")
    assert not small_gemm.available() and small_gemm.unavailable_reason() == "MBRIDGE_EPOVERLAP_SMALL_GEMM=0"
    if packed.available(torch.float32):
        w1, w2 = torch.randn(2, 64, 32) * 0.05, torch.randn(2, 32, 32) * 0.05
        experts = packed.PackedExperts(w1, w2)
        assert not experts.tiles
        x = torch.randn(3, 32)
        torch.testing.assert_close(experts.swiglu(x, [1, 2]), grouped_expert_swiglu(x, w1, w2, [1, 2]),
                                   rtol=1e-5, atol=1e-6)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A build into an empty cache, forgotten afterwards (the process's library stays the one it loaded)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    small_gemm._library.cache_clear()
    yield tmp_path
    small_gemm._library.cache_clear()


def test_without_a_compiler_it_says_so_and_is_unavailable(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not small_gemm.available()
    assert small_gemm.unavailable_reason() == "CC=no-such-compiler-here is not a program here"
    with pytest.raises(RuntimeError, match="do not run here"):
        small_gemm.grouped(torch.zeros(1, 8), [(0, 1)], [torch.zeros(1, 8, 32)], torch.zeros(1, 32))


def test_a_compile_error_is_reported_and_nothing_half_built_is_left(fresh_build, monkeypatch, tmp_path_factory):
    broken = tmp_path_factory.mktemp("src") / "small_gemm.c"
    broken.write_text("int small_gemm_tile(void) { return }\n")
    monkeypatch.setattr(small_gemm, "SOURCE", broken)
    if build.compiler() is None:
        pytest.skip("no C compiler here")
    assert not small_gemm.available()
    assert "failed on small_gemm.c" in small_gemm.unavailable_reason()
    assert not any((fresh_build / "mbridge-epoverlap" / "native").iterdir())


@needs_library
def test_the_library_is_built_once_into_the_cache(fresh_build):
    assert small_gemm.available()
    built = list((fresh_build / "mbridge-epoverlap" / "native").glob("small_gemm-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    small_gemm._library.cache_clear()
    assert small_gemm.available() and built[0].stat().st_mtime_ns == stamp


@needs_library
def test_strided_rows_are_refused_not_misread():
    tiles = small_gemm.tiled(torch.zeros(32, 8))
    with pytest.raises(ValueError, match="contiguous fp32 rows"):
        small_gemm.grouped(torch.zeros(8, 2).T, [(0, 1)], [tiles], torch.zeros(2, 32))


@pytest.fixture
def kernel_threads():
    """Restores one thread for the tiled calls after a test that asks for more."""
    yield small_gemm.set_threads
    small_gemm.set_threads(1)


@needs_library
@pytest.mark.numerics
@pytest.mark.parametrize("threads", [2, 3])
def test_calls_shared_among_threads_give_the_bits_of_one_thread(kernel_threads, threads):
    """Each (expert, tile) unit is computed whole by whichever thread takes it: the same bits at any thread count,
    for groups of 1 to 70 rows, a call of one unit, and many calls in a row (helpers spinning, then sleeping)."""
    g = torch.Generator().manual_seed(7)
    weights = [small_gemm.tiled(torch.randn(64, 48, generator=g) * 0.1) for _ in range(9)]
    counts = [1, 70, 3, 4, 0, 5, 17, 2, 33]
    groups = [(sum(counts[:i]), n) for i, n in enumerate(counts)]
    x = torch.randn(sum(counts), 48, generator=g)
    one = torch.full((x.shape[0], 64), float("nan"))
    small_gemm.grouped(x, groups, weights, one)
    assert kernel_threads(threads) == threads == small_gemm.threads()
    for call in range(50):
        out = torch.full_like(one, float("nan"))
        small_gemm.grouped(x, groups, weights, out)
        assert torch.equal(out, one), f"call {call}"
    single = torch.full((1, 64), float("nan"))
    small_gemm.grouped(x[:1], [(0, 1)], weights[:1], single)
    assert torch.equal(single, one[:1])
    assert kernel_threads(1) == 1 and small_gemm.threads() == 1


@needs_library
def test_a_forked_child_computes_without_its_parents_helper_threads(kernel_threads):
    """A fork keeps the parent's settings but not its threads: the child's calls run on its own thread, and its
    own `set_threads` starts helpers of its own."""
    import multiprocessing

    kernel_threads(2)
    weight, x = small_gemm.tiled(_rand(64, 32, seed=2)), _rand(6, 32, seed=3)
    expected = torch.empty(6, 64)
    small_gemm.grouped(x, [(0, 6)], [weight], expected)
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        results = pool.apply_async(_child_calls, (x, weight)).get(timeout=60)
    assert all(torch.equal(r, expected) for r in results)


def _child_calls(x, weight):
    out = []
    for threads in (None, 2):
        if threads:
            small_gemm.set_threads(threads)
        y = torch.empty(x.shape[0], weight.shape[0] * weight.shape[2])
        small_gemm.grouped(x, [(0, x.shape[0])], [weight], y)
        out.append(y)
    return out


@needs_library
@pytest.mark.skipif(not packed.available(torch.float32), reason="this torch has no oneDNN linear ops")
def test_with_several_threads_experts_of_up_to_split_rows_take_the_tiles(one_thread, kernel_threads, monkeypatch):
    """With the tiled calls on several threads an expert of up to `SPLIT_ROWS` rows runs there, not on oneDNN: its
    bits are the tiled GEMM's; a larger one stays on oneDNN."""
    g = torch.Generator().manual_seed(8)
    w1, w2 = torch.randn(3, 64, 32, generator=g) * 0.05, torch.randn(3, 32, 32, generator=g) * 0.05
    counts = [small_gemm.SPLIT_ROWS, 9, small_gemm.SPLIT_ROWS + 1]
    x = torch.randn(sum(counts), 32, generator=g)
    experts = packed.PackedExperts(w1, w2)
    monkeypatch.setattr(packed, "PER_EXPERT_ROWS", 10**9)  # one activation over every row, not a prefill's per expert
    kernel_threads(2)
    tiled_groups = []
    grouped = small_gemm.grouped
    monkeypatch.setattr(small_gemm, "grouped", lambda x, groups, *rest: (tiled_groups.append(groups),
                                                                         grouped(x, groups, *rest)))
    got = experts.swiglu(x, counts)
    assert tiled_groups == [[(0, counts[0]), (counts[0], 9)]] * 2  # the up and the down GEMMs

    def tiled_expert(e):
        rows = x[sum(counts[:e]):sum(counts[:e + 1])]
        gate, up = small_gemm.reference_tiled_gemm(rows, w1[e]).chunk(2, dim=-1)
        return small_gemm.reference_tiled_gemm(torch.nn.functional.silu(gate) * up, w2[e])

    assert torch.equal(got[:counts[0]], tiled_expert(0))
    assert torch.equal(got[counts[0]:counts[0] + 9], tiled_expert(1))
    torch.testing.assert_close(got, grouped_expert_swiglu(x, w1, w2, counts), rtol=1e-5, atol=1e-6)


@needs_library
@pytest.mark.skipif(not packed.available(torch.float32), reason="this torch has no oneDNN linear ops")
def test_a_projection_of_a_few_rows_takes_the_tiles_and_follows_its_weight(one_thread, kernel_threads, monkeypatch):
    """The head and the attention projections (`PackedLinear`) run a product of up to `tiled_rows()` rows on their
    tiles, as the experts do: `SMALL_ROWS` with the tiled calls on one thread, `SPLIT_ROWS` on several, none with
    torch on several; a weight changed in place is tiled again before the next product."""
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(64, 48, generator=g) * 0.05
    linear = packed.PackedLinear(weight)
    calls = []
    grouped = small_gemm.grouped
    monkeypatch.setattr(small_gemm, "grouped", lambda x, *rest: (calls.append(x.shape[0]), grouped(x, *rest)))

    def product(rows: int) -> torch.Tensor:
        x = torch.randn(rows, 48, generator=g)
        out = linear(x.view(1, rows, 48))
        assert out.shape == (1, rows, 64)
        torch.testing.assert_close(out[0], x @ weight.T, rtol=1e-5, atol=1e-6)
        if calls and calls[-1] == rows:
            assert torch.equal(out[0], small_gemm.reference_tiled_gemm(x, weight))
        return out

    for threads, limit in ((1, small_gemm.SMALL_ROWS), (2, small_gemm.SPLIT_ROWS)):
        kernel_threads(threads)
        calls.clear()
        product(limit)
        product(limit + 1)
        assert calls == [limit], f"tiled calls with {threads} thread(s)"
    with torch.no_grad():
        weight[5].mul_(-3.0)
    calls.clear()
    product(7)
    assert calls == [7]
    torch.set_num_threads(2)  # a wide step: torch on every core, the tiles idle
    calls.clear()
    product(3)
    assert calls == []
