"""`m2n-bench` refuses message sizes whose run would not fit in memory, naming the limit."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.comm.m2n.bench import available_memory, check_sizes_fit, memory_needed
from mbridge_epoverlap.errors import UsageError
from tests.unit_tests.cli_runner import run_cli


def test_memory_grows_with_the_size_and_the_pairs():
    assert memory_needed(2, 1, 1) == 2 * memory_needed(1, 1, 1)
    assert memory_needed(1, 2, 2) > memory_needed(1, 1, 1)


def test_a_size_over_the_limit_names_the_limit_and_the_largest_that_fits():
    available = 1 << 30
    fits = (available // 2) // memory_needed(1, 1, 1)
    check_sizes_fit([fits], 1, 1, available)
    with pytest.raises(UsageError, match=f"limit of {available // 2:,} bytes.*largest that fits is {fits:,} bytes"):
        check_sizes_fit([2048, fits + 1], 1, 1, available)


def test_the_command_refuses_10g_without_a_traceback():
    if memory_needed(10 << 30, 1, 1) <= available_memory() // 2:
        pytest.skip("this machine has the memory for 10 GiB messages")
    done = run_cli("m2n-bench", "--senders", "1", "--receivers", "1", "--sizes", "10G", timeout=60)
    assert done.returncode == 2
    assert "--sizes: a 10,737,418,240-byte message" in done.stderr and "limit of" in done.stderr
    assert "Traceback" not in done.stderr
