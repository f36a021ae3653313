"""`profile` reads gzip-compressed Nsight Systems exports and Kineto traces as it reads plain ones."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.profiling.analyze import analyze_trace
from mbridge_epoverlap.profiling.sources import expand, sniff
from tests.unit_tests.cli_runner import REPO

DATA = REPO / "tests" / "unit_tests" / "profiling" / "data"


def _unpack(packed: Path, folder: Path) -> Path:
    plain = folder / packed.name.removesuffix(".gz")
    with gzip.open(packed, "rb") as src, open(plain, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return plain


@pytest.mark.parametrize("packed", [DATA / "nsys" / "nsysai_mfu_2gpu_after.sqlite.gz",
                                    DATA / "gloo_cpu" / "rank0.json.gz"], ids=lambda p: p.name)
def test_compressed_and_plain_traces_give_the_same_figures(tmp_path, packed):
    plain = _unpack(packed, tmp_path)
    assert sniff(str(packed)) == sniff(str(plain))
    compressed, unpacked = analyze_trace(str(packed)).totals(), analyze_trace(str(plain)).totals()
    assert compressed == unpacked and compressed["kernels"] > 0


def test_a_folder_of_compressed_exports_is_read(tmp_path):
    for name in ("nsysai_mfu_2gpu_before.sqlite.gz", "nsysai_mfu_2gpu_after.sqlite.gz"):
        shutil.copy(DATA / "nsys" / name, tmp_path / name)
    assert len(expand(str(tmp_path))) == 2


def test_a_damaged_gzip_is_a_usage_error(tmp_path):
    broken = tmp_path / "run.sqlite.gz"
    broken.write_bytes(gzip.compress(b"SQLite format 3\x00" + b"\x00" * 200)[:30])
    with pytest.raises(UsageError, match="run.sqlite.gz"):
        analyze_trace(str(broken))
