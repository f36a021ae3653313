"""Nsight Systems SQLite exports: synthetic known answers, schema variants, public exports."""

from __future__ import annotations

import sqlite3

import pytest
from profiling_synth import DEEPEP_COMBINE, DEEPEP_DISPATCH, ELEMENTWISE, GEMM, write_nsys

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.profiling import analyze_trace
from mbridge_epoverlap.profiling.nsys import read_nvtx

NCCL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
KERNELS = [
    # device 0: GEMMs on stream 7 (touching), one nested on stream 8, DeepEP on comm stream 20
    (0, 100, 0, 7, GEMM),
    (100, 250, 0, 7, GEMM),
    (300, 400, 0, 7, ELEMENTWISE),
    (320, 350, 0, 8, GEMM),
    (50, 120, 0, 20, DEEPEP_DISPATCH),
    (380, 500, 0, 20, DEEPEP_COMBINE),
    # device 1: NCCL on the compute stream, serialised with the GEMM
    (0, 100, 1, 7, NCCL),
    (100, 200, 1, 7, GEMM),
]
NVTX = [
    (40, 130, 59, "moe_dispatch", None, 1000),  # push/pop, inline text
    (370, 510, 60, None, "combine", 1000),  # start/end, name via textId
    (-50, 10, 59, "dispatch (warm-up)", None, 1000),  # opened before profiling started
    (0, 40, 59, "pre_dispatch", None, 1000),  # compute stage, not a dispatch
    (5, 5, 34, "dispatch mark", None, 1000),  # mark: no length
    (600, None, 59, "dispatch never closed", None, 1000),
    (-100, 260, 59, "iteration 1", None, 1000),
    (260, 700, 59, "iteration 2", None, 1000),
    (0, 300, 59, "moe_dispatch", None, 1001),  # the other process
]


@pytest.fixture()
def synthetic(tmp_path):
    return write_nsys(
        tmp_path / "synthetic.sqlite",
        KERNELS,
        pid_of_device={0: 1000, 1: 1001},
        memcpy=[(600, 650, 0)],
        nvtx=NVTX,
    )


def _dev(report, device):
    return next(d for d in report.devices if d.device == device)


def test_known_overlap(synthetic):
    report = analyze_trace(str(synthetic))
    d0, d1 = _dev(report, 0), _dev(report, 1)
    assert (d0.pid, d1.pid) == (1000, 1001)
    assert (d0.kernels, d0.comm_kernels, d0.memory_ops) == (6, 2, 1)
    assert d0.compute_ns == 350  # [0,250) + [300,400)
    assert d0.comm_ns == 190  # [50,120) + [380,500)
    assert d0.overlap_ns == 90  # 70 + 20
    assert d0.exposed_comm_ns == 100
    assert d0.active_ns == 500  # [0,250) + [300,500) + memcpy [600,650)
    assert d0.overlap_pct == pytest.approx(100 * 90 / 190, abs=1e-4)
    assert d0.nvtx == {"dispatch_ns": 150, "combine_ns": 140, "ranges": 3, "dispatch_ranges": 2, "combine_ranges": 1}
    assert (d1.comm_ns, d1.compute_ns, d1.overlap_ns, d1.exposed_comm_ns) == (100, 100, 0, 100)
    assert d1.nvtx["dispatch_ns"] == 300


def test_time_window_clips(synthetic):
    d0 = _dev(analyze_trace(str(synthetic), window="0:200"), 0)  # origin = first kernel = 0
    assert (d0.compute_ns, d0.comm_ns, d0.overlap_ns, d0.active_ns) == (200, 70, 70, 200)
    assert d0.kernels == 3 and d0.window_ns == [0, 200]
    assert d0.nvtx["dispatch_ns"] == 10 + 90  # [0,10) of the warm-up range + [40,130)


def test_step_window(synthetic):
    report = analyze_trace(str(synthetic), window="steps:2")
    d0 = _dev(report, 0)
    assert d0.window_ns == [260, 700]
    assert (d0.compute_ns, d0.comm_ns, d0.overlap_ns, d0.active_ns) == (100, 120, 20, 250)
    assert _dev(report, 1).window_ns == [260, 700]  # no step ranges of its own: the file's


def test_missing_steps_name_the_ones_found(synthetic):
    with pytest.raises(UsageError, match=r"selects no step ranges \(steps found: 1, 2\)"):
        analyze_trace(str(synthetic), window="steps:5:6")


def test_old_schema_without_global_pid_or_nvtx(tmp_path):
    path = write_nsys(tmp_path / "old.sqlite", KERNELS[:6], global_pid=False, nvtx_table=False)
    report = analyze_trace(str(path))
    (d0,) = report.devices
    assert d0.pid is None and (d0.comm_ns, d0.overlap_ns) == (190, 90)
    assert any("no globalPid" in n for n in report.notes) and any("NVTX_EVENTS" in n for n in report.notes)


def test_user_regex_reclassifies(tmp_path):
    path = write_nsys(tmp_path / "custom.sqlite", [(0, 100, 0, 7, GEMM), (50, 150, 0, 9, "my_a2a_kernel")])
    assert analyze_trace(str(path)).devices[0].comm_ns == 0
    d0 = analyze_trace(str(path), comm_regex="my_a2a").devices[0]
    assert (d0.comm_ns, d0.overlap_ns, d0.compute_ns) == (100, 50, 100)


def test_sparse_row_ids(tmp_path):
    path = write_nsys(tmp_path / "sparse.sqlite", [(0, 100, 0, 7, GEMM), (50, 150, 0, 20, DEEPEP_DISPATCH)])
    con = sqlite3.connect(path)
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET rowid = 9000000000000 WHERE rowid = 2")
    con.commit()
    con.close()
    d = analyze_trace(str(path)).devices[0]
    assert (d.kernels, d.comm_ns, d.overlap_ns) == (2, 100, 50)


def test_empty_kernel_table_reports_zeros(tmp_path):
    report = analyze_trace(str(write_nsys(tmp_path / "empty.sqlite", [])))
    (d,) = report.devices
    assert (d.kernels, d.comm_ns, d.compute_ns, d.active_ns, d.overlap_pct) == (0, 0, 0, 0, None)


def test_no_kernel_table_is_a_usage_error(tmp_path):
    path = write_nsys(tmp_path / "nokernels.sqlite", [], kernel_table=False)
    with pytest.raises(UsageError, match="no CUPTI_ACTIVITY_KIND_KERNEL table"):
        analyze_trace(str(path))


def test_unrelated_sqlite_is_a_usage_error(tmp_path):
    path = tmp_path / "other.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    with pytest.raises(UsageError, match="no CUPTI_ACTIVITY_KIND_KERNEL table"):
        analyze_trace(str(path))


def test_corrupt_sqlite_is_a_usage_error(tmp_path):
    path = tmp_path / "bad.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)
    with pytest.raises(UsageError, match="bad.sqlite"):
        analyze_trace(str(path))


# -- public exports ----------------------------------------------------------------------------------


def test_nsysai_mfu_before_after_show_nccl(nsys_dir):
    for name in ("nsysai_mfu_2gpu_before", "nsysai_mfu_2gpu_after"):
        report = analyze_trace(str(nsys_dir / f"{name}.sqlite"))
        assert [d.device for d in report.devices] == [0, 1]
        assert len({d.pid for d in report.devices}) == 2
        for d in report.devices:
            assert d.comm_kernels > 0 and d.comm_ns > 0
            assert d.compute_ns > 5 * d.comm_ns
            assert d.overlap_ns <= d.comm_ns and d.exposed_comm_ns == d.comm_ns - d.overlap_ns
            assert d.active_ns >= max(d.comm_ns, d.compute_ns)
    before = analyze_trace(str(nsys_dir / "nsysai_mfu_2gpu_before.sqlite"))
    assert [d.kernels for d in before.devices] == [1993, 2017]
    assert sum(d.comm_kernels for d in before.devices) == 66


def test_nsysai_healthy_minimal_schema(nsys_dir):
    report = analyze_trace(str(nsys_dir / "nsysai_healthy_1pct.sqlite"))
    (d,) = report.devices
    assert d.pid is None and d.kernels == 400 and d.comm_ns == 0 and d.compute_ns > 0
    assert d.nvtx["ranges"] == 0


def test_nsysai_mock_two_kernels(nsys_dir):
    (d,) = analyze_trace(str(nsys_dir / "nsysai_mock.sqlite")).devices
    assert d.kernels == 2 and d.memory_ops == 1 and d.active_ns > d.compute_ns


def test_pipit_2022_nvtx_names_via_text_id(nsys_dir):
    path = str(nsys_dir / "pipit_saxpy_mpi_cuda_nsys2022.sqlite")
    ranges = read_nvtx(path)
    assert ranges.names.count("MPI_Send") == 10 and ranges.names.count("MPI_Recv") == 5
    assert "saxpy" in ranges.names  # inline text
    assert set(ranges.pid.tolist()) == {1230493}
    (d,) = analyze_trace(path).devices
    assert d.kernels == 5 and d.pid == 1230493 and d.comm_ns == 0


def test_pipit_2024_schema(nsys_dir):
    (d,) = analyze_trace(str(nsys_dir / "pipit_cloverleaf_cuda_nsys2024.sqlite")).devices
    assert d.kernels == 1312 and d.comm_ns == 0 and d.memory_ops > 0
