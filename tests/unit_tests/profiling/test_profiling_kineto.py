"""Kineto/Chrome traces: streamed reading, GPU and CPU rules, public traces."""

from __future__ import annotations

import gzip
import io
import json
from decimal import ROUND_HALF_UP, Decimal

import pytest
from profiling_synth import DEEPEP_COMBINE, DEEPEP_DISPATCH, ELEMENTWISE, GEMM, kineto_event, write_kineto

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.profiling import analyze_trace, jsonstream
from mbridge_epoverlap.profiling.jsonstream import EventScanner, micros_to_ns

BASE_NS = 1_700_000_000_000_000_000  # epoch-like: float64 microseconds cannot hold this to the ns
HOST = 4242


def _us(ns: int) -> str:
    """Exact decimal microseconds of BASE_NS + ns."""
    t = BASE_NS + ns
    return f"{t // 1000}.{t % 1000:03d}"


def _dur(ns: int) -> str:
    return f"{ns // 1000}.{ns % 1000:03d}"


def _k(start, end, dev, stream, name, cat="kernel"):
    return kineto_event(cat, name, dev, stream, _us(start), _dur(end - start))


def _a(start, end, name, tid=HOST, cat="user_annotation"):
    return kineto_event(cat, name, HOST, tid, _us(start), _dur(end - start))


GPU_EVENTS = [
    _k(0, 100_000, 0, 7, GEMM),
    _k(100_000, 250_000, 0, 7, GEMM),
    _k(300_000, 400_000, 0, 7, ELEMENTWISE),
    _k(320_000, 350_000, 0, 8, GEMM),
    _k(50_000, 120_000, 0, 20, DEEPEP_DISPATCH),
    _k(380_000, 500_000, 0, 20, DEEPEP_COMBINE),
    _k(600_000, 650_000, 0, 7, "Memcpy HtoD (Pinned -> Device)", cat="gpu_memcpy"),
    _k(700_000, 701_000, 0, 7, "Memset (Device)", cat="gpu_memset"),
    _a(40_000, 130_000, "moe_dispatch"),
    _a(370_000, 510_000, "moe_combine"),
    _a(-100_000, 260_000, "ProfilerStep#1"),
    _a(260_000, 800_000, "ProfilerStep#2"),
    kineto_event("cpu_op", "aten::mm", HOST, HOST, _us(0), "5.0"),
    kineto_event("cuda_runtime", "cudaLaunchKernel", HOST, HOST, _us(1), "2.0"),
]


def _check_gpu(d):
    assert (d.pid, d.device, d.rank) == (HOST, 0, 0)
    assert (d.kernels, d.comm_kernels, d.memory_ops) == (6, 2, 2)
    assert (d.compute_ns, d.comm_ns, d.overlap_ns, d.exposed_comm_ns) == (350_000, 190_000, 90_000, 100_000)
    assert d.active_ns == 450_000 + 50_000 + 1_000  # kernels, memcpy, memset
    assert d.nvtx["dispatch_ns"] == 90_000 and d.nvtx["combine_ns"] == 140_000 and d.nvtx["ranges"] == 2


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("pretty", [False, True])
def test_gpu_known_overlap(tmp_path, gz, pretty):
    path = write_kineto(tmp_path / ("t.json.gz" if gz else "t.json"), GPU_EVENTS, gz=gz, pretty=pretty)
    (d,) = analyze_trace(str(path)).devices
    _check_gpu(d)


def test_gpu_windows(tmp_path):
    path = str(write_kineto(tmp_path / "t.json", GPU_EVENTS))
    (d,) = analyze_trace(path, window="0:0.2ms").devices  # origin = first GPU event
    assert (d.compute_ns, d.comm_ns, d.overlap_ns, d.kernels) == (200_000, 70_000, 70_000, 3)
    (d,) = analyze_trace(path, window="steps:2:2").devices
    assert (d.compute_ns, d.comm_ns, d.overlap_ns, d.memory_ops) == (100_000, 120_000, 20_000, 2)
    with pytest.raises(UsageError, match=r"steps found: 1, 2"):
        analyze_trace(path, window="steps:3:8")


def _reordered(text: str) -> str:
    ev = json.loads(text)
    return kineto_event(
        ev["cat"],
        ev["name"],
        ev["pid"],
        ev["tid"],
        text.split('"ts": ')[1].split(",")[0],
        text.split('"dur": ')[1].split(",")[0],
        reorder=True,
    )


def test_other_key_order_takes_the_slow_path(tmp_path, monkeypatch):
    path = write_kineto(tmp_path / "sorted.json", [_reordered(t) for t in GPU_EVENTS])
    assert '{"args": ' in path.read_text()
    scanners = []
    real = EventScanner.scan

    def spy(self, stream):
        scanners.append(self)
        return real(self, stream)

    monkeypatch.setattr(EventScanner, "scan", spy)
    (d,) = analyze_trace(str(path)).devices
    _check_gpu(d)
    assert scanners[0].slow_blocks > 0 and scanners[0].fast_blocks == 0


@pytest.mark.parametrize("reorder", [False, True])
@pytest.mark.parametrize("block", [7, 64, 500])
def test_tiny_blocks_give_the_same_answer(tmp_path, monkeypatch, block, reorder):
    events = [_reordered(t) for t in GPU_EVENTS] if reorder else GPU_EVENTS
    path = write_kineto(tmp_path / "t.json", events + ['{"ph": "M", "name": "x {\\"ph\\": 1}", "pid": 1}'])
    monkeypatch.setattr(jsonstream, "_BLOCK", block)
    monkeypatch.setattr(jsonstream, "_MAX_PENDING", 4 * block)
    (d,) = analyze_trace(str(path)).devices
    _check_gpu(d)


def test_exact_microsecond_conversion():
    assert micros_to_ns("1700000000000000.1235") == 1_700_000_000_000_000_124  # half rounds away from zero
    assert micros_to_ns("0.0004999") == 0 and micros_to_ns("0.0005") == 1
    assert micros_to_ns("-12.5") == -12_500 and micros_to_ns("-0.5") == -500
    assert micros_to_ns(7) == 7_000 and micros_to_ns("1.5e3") == 1_500_000
    events = [
        kineto_event("kernel", "k", 0, 7, "1700000000000000.1235", "0.0005"),
        kineto_event("kernel", "k", 0, 7, "-12.5", "3"),
    ]
    res = EventScanner("x", ("kernel",)).scan(io.BytesIO(write_kineto_bytes(events)))
    assert sorted(res.start.tolist()) == [-12_500, 1_700_000_000_000_000_124]
    assert sorted(res.dur.tolist()) == [1, 3_000]


def write_kineto_bytes(events):
    return ('{"traceEvents": [' + ", ".join(events) + "]}").encode()


def test_escaped_names_and_bare_array(monkeypatch):
    names = ['void deep_ep::dispatch<"q">\\path', "caf\u00e9 {lambda()#1}", "plain"]
    text = "[" + ", ".join(kineto_event("kernel", n, 0, 7, f"{i}.0", "2.0") for i, n in enumerate(names)) + "]"
    monkeypatch.setattr(jsonstream, "_BLOCK", 40)  # several blocks, so the regex path runs too
    scanner = EventScanner("x", ("kernel",))
    res = scanner.scan(io.BytesIO(text.encode()))
    assert [res.names[i] for i in res.name] == names
    assert scanner.fast_blocks > 0


def test_cpu_trace_rule(tmp_path):
    gloo_tid = 60
    events = [
        _a(0, 300_000, "ProfilerStep#1"),
        kineto_event("cpu_op", "aten::mm", HOST, HOST, _us(0), _dur(100_000)),
        kineto_event("cpu_op", "aten::add", HOST, HOST, _us(20_000), _dur(10_000)),
        _a(0, 150_000, "experts"),
        _a(140_000, 170_000, "dispatch"),
        kineto_event("cpu_op", "c10d::alltoall_base_", HOST, HOST, _us(150_000), _dur(10_000)),
        _a(120_000, 220_000, "gloo:all_to_all", tid=gloo_tid),
        kineto_event("cpu_op", "aten::copy_", HOST, gloo_tid, _us(130_000), _dur(10_000)),  # inside the transfer
        _a(250_000, 300_000, "attention"),
        kineto_event("cpu_op", "aten::bmm", HOST, HOST, _us(255_000), _dur(35_000)),
    ]
    report = analyze_trace(str(write_kineto(tmp_path / "cpu.json", events, rank=3)))
    (d,) = report.devices
    assert (d.device, d.kind, d.pid, d.rank) == ("cpu", "cpu", HOST, 3)
    assert d.compute_ns == 150_000 + 50_000  # copy_ inside gloo on its thread does not count
    assert d.comm_ns == 100_000 and d.overlap_ns == 30_000 and d.exposed_comm_ns == 70_000
    assert d.active_ns == 220_000 + 50_000
    assert (d.kernels, d.comm_kernels) == (7, 1)
    assert d.nvtx["dispatch_ns"] == 30_000 and d.nvtx["dispatch_ranges"] == 1
    assert any("CPU trace" in n for n in report.notes)
    (w,) = analyze_trace(str(tmp_path / "cpu.json"), window="steps:1").devices
    assert (w.compute_ns, w.comm_ns, w.overlap_ns) == (200_000, 100_000, 30_000)


def test_trace_without_events_reports_zeros(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text('{"schemaVersion": 1, "traceEvents": []}')
    (d,) = analyze_trace(str(path)).devices
    assert (d.kernels, d.comm_ns, d.compute_ns, d.overlap_ns, d.active_ns, d.overlap_pct) == (0, 0, 0, 0, 0, None)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty file"),
        (b"hello, not a trace", "not a trace"),
        (b'{"schemaVersion": 1, "events": []}', "without a traceEvents array"),
        (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1', "truncated"),
        (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k" "pid": 0}]}', "malformed"),
        (b"{ not json", "not valid JSON"),
    ],
)
def test_bad_json_inputs(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=message) as err:
        analyze_trace(str(path))
    assert "bad.json" in str(err.value)


def test_truncated_gzip(tmp_path, data_dir):
    packed = (data_dir / "kineto" / "hta_sampled_rank-0.json.gz").read_bytes()
    path = tmp_path / "cut.json.gz"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(UsageError, match="cut.json.gz: compressed stream is damaged or truncated"):
        analyze_trace(str(path))


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(UsageError, match="no such file or directory"):
        analyze_trace(str(tmp_path / "nope.json"))
    with pytest.raises(UsageError, match="folder holds no trace files"):
        analyze_trace(str(tmp_path))


# -- public and project traces ---------------------------------------------------------------------


def _reference(path):
    """Straightforward figures from json.load, for cross-checking."""
    with gzip.open(path) as fh:
        events = json.load(fh, parse_float=Decimal, parse_int=Decimal)["traceEvents"]

    def ns(x):
        return int((x * 1000).to_integral_value(ROUND_HALF_UP))

    def merge(pairs):
        out = []
        for s, e in sorted(pairs):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            elif e > s:
                out.append([s, e])
        return out

    kern = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    comm = merge([(ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])) for e in kern if "nccl" in e["name"]])
    comp = merge([(ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])) for e in kern if "nccl" not in e["name"]])
    overlap = sum(max(0, min(a[1], b[1]) - max(a[0], b[0])) for a in comm for b in comp)
    return len(kern), sum(e - s for s, e in comm), sum(e - s for s, e in comp), overlap


@pytest.mark.parametrize("rank", [0, 1])
def test_hta_sampled_ranks_show_nccl_sendrecv(data_dir, rank):
    path = data_dir / "kineto" / f"hta_sampled_rank-{rank}.json.gz"
    (d,) = analyze_trace(str(path)).devices
    assert (d.rank, d.device, d.comm_kernels, d.memory_ops) == (rank, rank, 10, 50)
    assert (d.kernels, d.comm_ns, d.compute_ns, d.overlap_ns) == _reference(path)
    assert 0 < d.overlap_ns < d.comm_ns and d.active_ns >= d.comm_ns


def test_hta_sampled_rank0_figures(data_dir):
    (d,) = analyze_trace(str(data_dir / "kineto" / "hta_sampled_rank-0.json.gz")).devices
    assert (d.kernels, d.comm_ns, d.compute_ns, d.overlap_ns) == (1154, 396_199_000, 210_320_000, 59_216_000)
    assert (d.exposed_comm_ns, d.active_ns, d.overlap_pct) == (336_983_000, 547_656_000, 14.946)


def test_hta_cpu_only_gloo_is_a_cpu_trace(data_dir):
    report = analyze_trace(str(data_dir / "kineto" / "hta_cpu_only_gloo_rank-34.json.gz"))
    (d,) = report.devices
    assert (d.kind, d.device, d.rank, d.pid) == ("cpu", "cpu", 34, 1074)
    assert d.comm_kernels == 10 and d.comm_ns > 1_000_000_000  # five all_reduce rounds on two gloo threads
    assert d.kernels == 14 and d.compute_ns < 10_000  # four tiny aten::empty on the main thread


def test_rocm_trace_without_communication(data_dir):
    (d,) = analyze_trace(str(data_dir / "kineto" / "hta_mi250_minitoy_rocm.json.gz")).devices
    assert (d.kernels, d.comm_ns, d.overlap_pct, d.device, d.memory_ops) == (14, 0, None, 2, 2)


def test_project_gloo_folder_is_one_multi_rank_report(data_dir):
    report = analyze_trace(str(data_dir / "gloo_cpu"))
    assert [d.rank for d in report.devices] == [0, 1] and len(report.files) == 2
    for d in report.devices:
        assert d.kind == "cpu" and d.comm_kernels == 6 and d.comm_ns > 0 and d.compute_ns > 0
        assert d.nvtx["dispatch_ranges"] == 3 and d.nvtx["combine_ranges"] == 3
        assert d.overlap_ns <= min(d.comm_ns, d.compute_ns)
    assert any(d.overlap_ns > 0 for d in report.devices)


def _as_begin_end(texts: list[str]) -> list[str]:
    """The same events written as Chrome `B`/`E` pairs (the `E` carries only ph, pid, tid and ts), in time
    order, so pairs nest per thread as the format requires."""
    marks = []
    for text in texts:
        ev = json.loads(text, parse_float=Decimal)
        start = int(Decimal(text.split('"ts": ')[1].split(",")[0]) * 1000) - BASE_NS
        dur = int(Decimal(text.split('"dur": ')[1].split(",")[0]) * 1000)
        head = {"cat": ev["cat"], "name": ev["name"], "pid": ev["pid"], "tid": ev["tid"]}
        begin = json.dumps({"ph": "B", **head})[:-1] + f', "ts": {_us(start)}}}'
        end = json.dumps({"ph": "E", "pid": ev["pid"], "tid": ev["tid"]})[:-1] + f', "ts": {_us(start + dur)}}}'
        marks += [(start, 1, -dur, begin), (start + dur, 0, dur, end)]  # at one time: ends first, outer first
    return [text for *_, text in sorted(marks)]


@pytest.mark.parametrize("block", [None, 64])
def test_begin_end_pairs_are_read_like_complete_events(tmp_path, monkeypatch, block):
    timed = [t for t in GPU_EVENTS if '"cpu_op"' not in t and '"cuda_runtime"' not in t]
    others = [t for t in GPU_EVENTS if t not in timed]
    # An unwanted category nests around the stream-7 kernels, and a stray E opens the stream: neither may
    # shift a pair.
    wrapper = kineto_event("cpu_op", "aten::wrapper", 0, 7, _us(-10), "0")
    events = (['{"ph": "E", "pid": 0, "tid": 7, "ts": 1}']
              + _as_begin_end(timed + [wrapper.replace('"dur": 0', '"dur": 1000.000')]) + others)
    path = write_kineto(tmp_path / "be.json", events)
    assert '"ph": "X", "cat": "kernel"' not in path.read_text()
    if block is not None:  # pairs split across blocks keep their stacks
        monkeypatch.setattr(jsonstream, "_BLOCK", block)
        monkeypatch.setattr(jsonstream, "_MAX_PENDING", 4 * block)
    (d,) = analyze_trace(str(path)).devices
    _check_gpu(d)
