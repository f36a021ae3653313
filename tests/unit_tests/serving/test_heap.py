"""`engine.heap.keep_freed_memory`: a worker's large tensors come from its heap (kept between steps) where glibc's
default maps each one afresh. Run in child processes: the test process keeps its own malloc settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Where a 20 MiB and a 40 MiB tensor land: in the [heap] mapping, or a mapping of their own.
CHILD = """
import json, sys, torch
from mbridge_epoverlap.serving.engine import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
def in_heap(address):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            low, high = (int(a, 16) for a in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False
placed = {}
for mib in (20, 40):
    x = torch.empty(mib << 18)
    x.fill_(1.0)
    placed[mib] = in_heap(x.data_ptr())
    del x
print(json.dumps({"kept": kept, "in_heap": placed}))
"""


def _placement(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc/self/maps")
def test_large_tensors_come_from_the_kept_heap_up_to_the_mapping_threshold():
    default, kept = _placement("default"), _placement("keep")
    if kept["kept"] is False:
        pytest.skip("the C library here is not glibc (no mallopt)")
    assert kept["kept"] is True
    assert default["in_heap"] == {"20": False, "40": False}  # glibc maps each afresh, unmapped when freed
    assert kept["in_heap"] == {"20": True, "40": False}  # below MAP_FROM_BYTES (32 MiB) from the heap
