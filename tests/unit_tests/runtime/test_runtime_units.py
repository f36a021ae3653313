"""In-process tests of the MoE pieces and the executor (no process groups: EP = 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mbridge_epoverlap.comm.alltoall import CommContext
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.moe.dispatcher import AllToAllDispatcher, _source_to_expert_order
from mbridge_epoverlap.moe.experts import GroupedExperts
from mbridge_epoverlap.moe.router import Routing, TopKRouter
from mbridge_epoverlap.moe.wgrad import DOWN_PROJECTION, WeightGradStore, linear
from mbridge_epoverlap.runtime.executor import ScheduleExecutor
from mbridge_epoverlap.runtime.metrics import RunMetrics, model_flops_per_iteration, tflops_per_gpu
from mbridge_epoverlap.runtime.options import Fault, RuntimeOptions
from mbridge_epoverlap.runtime.train import num_micro_batches, schedule_for
from mbridge_epoverlap.runtime.worker import rank_and_world
from mbridge_epoverlap.schedule.training_orders import one_f_one_b
from tests.unit_tests.runtime.tiny_runs import micro_batches, tiny_model


def test_store_queues_under_capture_and_runs_in_order():
    store, seen = WeightGradStore(), []
    with store.capture("a"):
        store.put(lambda: seen.append(1))
        store.put(lambda: seen.append(2))
    store.put(lambda: seen.append(0))  # not capturing: runs at once
    assert seen == [0] and store.pending() == ["a"]
    assert store.flush("a") == 2 and seen == [0, 1, 2] and store.pending() == []
    with store.capture("b"), pytest.raises(RuntimeError, match="already capturing"), store.capture("c"):
        pass


def test_deferred_linear_matches_autograd():
    x = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    g = torch.randn(5, 3, 6, dtype=torch.float64)
    torch.nn.functional.linear(x_ref, w_ref).backward(g)
    store = WeightGradStore()
    with store.capture("k"):
        linear(x, w, store).backward(g)
    assert w.grad is None  # deferred
    torch.testing.assert_close(x.grad, x_ref.grad)
    store.flush("k")
    torch.testing.assert_close(w.grad, w_ref.grad)


def _reference_experts(x, w1, w2, counts):
    outs, start = [], 0
    for e, n in enumerate(counts):
        h = x[start:start + n] @ w1[e].t()
        gate, up = h.chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up) @ w2[e].t())
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 4], [2, 2, 2], [0, 0, 0]])
def test_grouped_experts_dgrad_and_delayed_wgrad_match_autograd(counts):
    torch.manual_seed(0)
    experts = GroupedExperts(3, 8, 5, dtype=torch.float64)
    torch.nn.init.normal_(experts.w1)
    torch.nn.init.normal_(experts.w2)
    x = torch.randn(sum(counts), 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(sum(counts), 8, dtype=torch.float64)
    w1, w2 = experts.w1.detach().clone().requires_grad_(), experts.w2.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    _reference_experts(x_ref, w1, w2, counts).backward(g)
    store = WeightGradStore()
    out = experts(x, counts, store)
    torch.testing.assert_close(out, _reference_experts(x.detach(), w1.detach(), w2.detach(), counts))
    with store.capture("experts"):
        out.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert experts.w1.grad is None and experts.w2.grad is None
    # The gate/up and down projections' weight gradients queue apart, so a schedule can run them apart.
    assert store.flush("experts") == 1
    torch.testing.assert_close(experts.w1.grad, w1.grad)
    assert experts.w2.grad is None
    assert store.flush(("experts", DOWN_PROJECTION)) == 1
    torch.testing.assert_close(experts.w2.grad, w2.grad)
    assert store.pending() == []


def test_router_topk_and_forced_balance():
    router = TopKRouter(8, 6, 2, dtype=torch.float32)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(12, 8)
    r = router(x)
    assert r.experts.shape == (12, 2) and torch.allclose(r.weights.sum(-1), torch.ones(12))
    assert (r.experts[:, 0] != r.experts[:, 1]).all()
    balanced = TopKRouter(8, 6, 2, force_balance=True)
    torch.nn.init.normal_(balanced.weight)
    counts = torch.bincount(balanced(x).experts.reshape(-1), minlength=6)
    assert counts.tolist() == [4] * 6


def test_local_dispatch_round_trip_with_empty_experts():
    d = AllToAllDispatcher(4, 2, 1, None, CommContext())
    y = torch.randn(7, 5)
    experts = torch.tensor([[0, 2]] * 4 + [[2, 0]] * 3)  # experts 1 and 3 get nothing
    weights = torch.softmax(torch.randn(7, 2), dim=-1)
    grouped, handle = d.dispatch(y, Routing(experts, weights))
    assert handle.tokens_per_expert == [7, 0, 7, 0]
    out = d.combine(handle, grouped, weights)
    torch.testing.assert_close(out, y * weights.sum(-1, keepdim=True))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_source_to_expert_order_groups_by_expert_then_source(sources, local, data):
    counts = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=sources * local, max_size=sources * local)))
    counts = counts.view(sources, local)
    order = _source_to_expert_order(counts)
    assert sorted(order.tolist()) == list(range(int(counts.sum())))
    block = torch.repeat_interleave(torch.arange(sources * local), counts.reshape(-1))
    keys = [(int(b) % local, int(b) // local) for b in block[order]]
    assert keys == sorted(keys)


@pytest.mark.parametrize(("recipe", "balanced"), [("qwen3_30b_a3b", False), ("qwen3_30b_a3b", True),
                                                  ("deepseek_v3", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_rank_schedules_bitwise_equal_and_match_autograd(make_tiny, recipe, balanced, dtype):
    cfg = make_tiny(1, recipe=recipe)
    cfg.model.moe_router_force_load_balancing = balanced  # balanced: the batched-GEMM expert path
    batches = micro_batches(cfg, 3)
    results = []
    # (overlap, delay, paired edges, split expert wgrad); paired False: Megatron-Core's edges
    orders = [(False, False, True, False), (True, False, True, False), (True, True, True, False),
              (False, True, True, False), (True, False, False, False), (True, True, False, False),
              (True, True, True, True), (True, True, False, True)]
    for overlap, delay, paired, split in orders:
        model = tiny_model(cfg, dtype)
        steps = one_f_one_b(3, cfg.model.num_layers, overlap=overlap, delay_wgrad=delay, paired_edges=paired,
                            split_expert_wgrad=split)
        losses = ScheduleExecutor(model, store=WeightGradStore()).run(steps, batches, loss_scale=1 / 3)
        results.append((losses, [p.main_grad.clone() for p in model.parameters()]))
    for losses, grads in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(losses, results[0][0], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1], strict=True))
    reference = tiny_model(cfg, dtype)
    for tokens, labels in batches:
        (reference(tokens, labels) / 3).backward()
    for p, g in zip(reference.parameters(), results[0][1], strict=True):
        torch.testing.assert_close(p.main_grad, g)
    assert any(g.abs().sum() > 0 for g in results[0][1])


class _CountingStore(WeightGradStore):
    """A real store that also records how many closures each flush ran."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: dict[tuple[int, int, str], int] = {}

    def flush(self, key):  # noqa: ANN001, ANN201 - same signature as the base class
        ran = super().flush(key)
        self.flushed[key] = ran
        return ran


def _deferrable(*modules) -> int:
    """Modules that queue one weight-gradient closure per backward (deferrable linears, grouped experts)."""
    return sum(hasattr(sub, "wgrad_store") for module in modules if module is not None for sub in module.modules())


@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b", "deepseek_v3"])
@pytest.mark.parametrize(("overlap", "delay"), [(False, False), (True, True)])
def test_wgrad_steps_run_the_closures_queued_in_the_executors_store(make_tiny, recipe, overlap, delay):
    cfg = make_tiny(1, recipe=recipe)
    model = tiny_model(cfg)
    store = _CountingStore()
    steps = one_f_one_b(3, cfg.model.num_layers, overlap=overlap, delay_wgrad=delay)
    executor = ScheduleExecutor(model, store=store)
    executor.run(steps, micro_batches(cfg, 3), loss_scale=1 / 3)
    ranges = [s.stage if s.phase.value == "run" else f"{s.stage}.{s.phase.value}" for s in steps]
    assert {name: len(times) for name, times in executor.step_s.items()} == {n: ranges.count(n) for n in ranges}
    expected = {}
    for mb in range(3):
        for number, layer in enumerate(model.layers):
            ffn = (layer.experts, layer.shared_expert) if layer.is_moe else (layer.mlp,)
            expected[(mb, number, "experts")] = _deferrable(*ffn)
            expected[(mb, number, "attn")] = _deferrable(layer.attention)
            # Grouped experts queue their down projection's weight gradient apart (`experts_wgrad_down`).
            expected[((mb, number, "experts"), DOWN_PROJECTION)] = 1 if layer.is_moe else 0
    assert store.flushed == expected
    assert any(n == 1 for key, n in expected.items() if key[1] == DOWN_PROJECTION)
    assert all(n > 0 for key, n in expected.items() if key[1] != DOWN_PROJECTION)


def test_executor_rejects_bad_schedules(make_tiny):
    cfg = make_tiny(1)
    steps = one_f_one_b(2, cfg.model.num_layers, overlap=False)
    with pytest.raises(RuntimeError, match="left work behind"):
        ScheduleExecutor(tiny_model(cfg)).run(steps[:-1], micro_batches(cfg, 2))
    with pytest.raises(ValueError, match=r"runs before \(1, 0, 'attn_dgrad'\) finished"):
        ScheduleExecutor(tiny_model(cfg)).run(list(reversed(steps)), micro_batches(cfg, 2))


def test_schedule_follows_the_model_switches(make_tiny):
    off, on = make_tiny(2), make_tiny(2, overlap=True, delay=True)
    assert schedule_for(off, 3) == one_f_one_b(3, 2, overlap=False)
    assert schedule_for(on, 3) == one_f_one_b(3, 2, overlap=True, delay_wgrad=True)
    assert schedule_for(on, 3, paired_edges=False) == one_f_one_b(3, 2, overlap=True, delay_wgrad=True,
                                                                  paired_edges=False)
    assert schedule_for(on, 3) != schedule_for(on, 3, paired_edges=False)
    assert num_micro_batches(off, 2) == 3
    off.train.global_batch_size = 5
    with pytest.raises(UsageError, match="global_batch_size"):
        num_micro_batches(off, 2)


def test_metrics_round_trip_and_flops(make_tiny):
    cfg = make_tiny(2)
    m = RunMetrics([0.5, 0.25, 0.25], [3.0, 2.0, 1.0], 0, 0, 1024, None, None)
    assert RunMetrics.from_dict(m.to_dict()) == m
    assert model_flops_per_iteration(cfg) > 0
    assert tflops_per_gpu(cfg, [1.0, 0.5]) == pytest.approx(model_flops_per_iteration(cfg) / 0.5 / 2 / 1e12)
    assert tflops_per_gpu(cfg, []) is None


def test_options_and_rank_environment():
    opts = RuntimeOptions.from_env({"MBRIDGE_EPOVERLAP_DTYPE": "fp32", "MBRIDGE_EPOVERLAP_FAULT": "1:hang:2"})
    assert opts.dtype == "fp32" and opts.fault == Fault(1, "hang", 2)
    assert opts.paired_edges is True
    assert RuntimeOptions.from_env({"MBRIDGE_EPOVERLAP_PAIRED_EDGES": "0"}).paired_edges is False
    assert opts.comm_channels == 2
    assert RuntimeOptions.from_env({"MBRIDGE_EPOVERLAP_COMM_CHANNELS": "1"}).comm_channels == 1
    assert opts.split_expert_wgrad is False
    assert RuntimeOptions.from_env({"MBRIDGE_EPOVERLAP_SPLIT_EXPERT_WGRAD": "1"}).split_expert_wgrad is True
    with pytest.raises(UsageError, match="SPLIT_EXPERT_WGRAD='on'.*use 1"):
        RuntimeOptions.from_env({"MBRIDGE_EPOVERLAP_SPLIT_EXPERT_WGRAD": "on"})
    with pytest.raises(UsageError, match="COMM_CHANNELS='3'.*use 2"):
        RuntimeOptions.from_env({"MBRIDGE_EPOVERLAP_COMM_CHANNELS": "3"})
    with pytest.raises(UsageError, match="PAIRED_EDGES='yes'.*Megatron-Core's order"):
        RuntimeOptions.from_env({"MBRIDGE_EPOVERLAP_PAIRED_EDGES": "yes"})


@pytest.mark.parametrize(("name", "value", "message"), [
    ("DTYPE", "fp8", "DTYPE='fp8': use fp32 or bf16"),
    ("FAULT", "x", "FAULT='x': expected RANK:MODE:ITERATION with MODE in"),
    ("COMM_TIMEOUT_S", "soon", "COMM_TIMEOUT_S='soon' is not a number"),
    ("PAIRED_EDGES", "yes", "PAIRED_EDGES='yes': use 1"),
])
def test_bad_runtime_options_name_the_variable_and_what_to_use(name, value, message):
    with pytest.raises(UsageError, match=f"^MBRIDGE_EPOVERLAP_{message}"):
        RuntimeOptions.from_env({f"MBRIDGE_EPOVERLAP_{name}": value})


def test_hidden_share_is_each_ranks_own_account():
    # Rank 0 hid 3 of 4 s of collectives in iterations 2-3, rank 1 all but 0.5 of 2 s: 1 - 1.5 / 6 over both.
    m = RunMetrics(step_times_s=[1.0, 1.0, 1.0], losses=[1.0, 1.0, 1.0],
                   comm_exposed_by_rank_s=[[9.0, 0.5, 0.5], [9.0, 0.25, 0.25]],
                   comm_collective_by_rank_s=[[9.0, 2.0, 2.0], [9.0, 1.0, 1.0]])
    share, worst = m.hidden_share(2, 3)
    assert share == pytest.approx(1 - 1.5 / 6) and worst == pytest.approx(0.75)
    assert m.hidden_share(1, 1) == (0.0, 0.0)
    assert RunMetrics.from_dict(m.to_dict()) == m
    assert RunMetrics(step_times_s=[1.0], losses=[1.0]).hidden_share(1, 1) is None
    assert rank_and_world({"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2, 1)
    assert rank_and_world({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}) == (3, 4, 1)
    with pytest.raises(UsageError, match="RANK"):
        rank_and_world({})


def test_package_import_stays_light():
    code = "import sys, mbridge_epoverlap.runtime; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_row_permutations_have_gather_backwards():
    from mbridge_epoverlap.moe.permute import expand_permute, permute_rows

    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    perm = torch.randperm(5)
    torch.autograd.gradcheck(lambda t: permute_rows(t, perm, torch.argsort(perm)), (x,))
    order = torch.randperm(10)  # 5 tokens x 2 slots
    torch.autograd.gradcheck(lambda t: expand_permute(t, order, torch.argsort(order), 2), (x,))
    assert torch.equal(expand_permute(x, order, torch.argsort(order), 2), x[order // 2])


def test_comm_priority_finds_threads_by_name_and_is_a_no_op_when_asked_for_none():
    import os
    import threading

    from mbridge_epoverlap.comm.priority import comm_thread_ids, raise_comm_priority

    prefix = ("mbeo-probe",)
    started, stop = threading.Event(), threading.Event()

    def probe():
        started.set()
        stop.wait(30)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        tid = thread.native_id
        assert tid not in comm_thread_ids(prefix)
        # The kernel's thread name is what gloo's threads carry; a thread may rename itself or its siblings.
        with open(f"/proc/self/task/{tid}/comm", "w") as fh:
            fh.write("mbeo-probe-1")
        assert comm_thread_ids(prefix) == [tid]
        before = os.getpriority(os.PRIO_PROCESS, tid)
        assert raise_comm_priority(0, prefixes=prefix) == 0
        assert os.getpriority(os.PRIO_PROCESS, tid) == before, "nice 0 changes nothing"
        # Lowering priority needs no privilege, so this path runs everywhere.
        assert raise_comm_priority(before + 1, prefixes=prefix) == 1
        assert os.getpriority(os.PRIO_PROCESS, tid) == before + 1
    finally:
        stop.set()
        thread.join(10)


def test_backend_choice_keeps_ranks_that_share_a_gpu_off_nccl():
    from mbridge_epoverlap.runtime.worker import choose_backend, local_world_size

    assert choose_backend("auto", use_cuda=False, ranks_on_node=2, gpus=0) == "gloo"
    assert choose_backend("auto", use_cuda=True, ranks_on_node=8, gpus=8) == "nccl"
    assert choose_backend("auto", use_cuda=True, ranks_on_node=2, gpus=1) == "gloo"  # two ranks, one GPU
    assert choose_backend("gloo", use_cuda=True, ranks_on_node=8, gpus=8) == "gloo"
    with pytest.raises(UsageError, match="NCCL needs a GPU per rank; use MBRIDGE_EPOVERLAP_BACKEND=gloo"):
        choose_backend("nccl", use_cuda=True, ranks_on_node=2, gpus=1)
    with pytest.raises(UsageError, match="BACKEND=nccl needs CUDA"):
        choose_backend("nccl", use_cuda=False, ranks_on_node=2, gpus=0)
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}, 16) == 4
    assert local_world_size({"SLURM_NTASKS_PER_NODE": "8"}, 16) == 8
    assert local_world_size({}, 16) == 16
    with pytest.raises(UsageError, match="BACKEND='mpi': use auto, nccl or gloo"):
        RuntimeOptions.from_env({"MBRIDGE_EPOVERLAP_BACKEND": "mpi"})
