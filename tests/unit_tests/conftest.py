"""Session-wide checks of the unit tests: the dependencies `MBRIDGE_EPOVERLAP_REQUIRE` names (see `requirements`),
and the `numerics` mark.

A test of the serving model or the training runtime whose name claims a numerical equality (bitwise, bit for
bit, equal, identical, as `transformers`) is a numerics test (the online server's excepted, below): `make test`
runs these again with the CPU math libraries held to each instruction set the machine can run
(`scripts/numerics_under_isas.py`), because such a claim may hold under one kernel and not under another.
`@pytest.mark.numerics` adds any other test.

Each pytest process shares its zygotes (`launch.zygote.share`, one per torch-import environment) with every launcher
of its tests, in-process or in a command a test starts (a server, the harness): their ranks are forked from them
instead of each command importing torch in a zygote of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit_tests.requirements import ENV_VAR, required_names

_NUMERICS_NAME = re.compile(r"bitwise|bit_for_bit|equal|identical|transformers")
_NUMERICS_DIRS = ("serving", "runtime")
# The online server's tests compare its answers with `transformers` too, but the server only carries token ids: its
# workers compute as the offline engine's, whose every family and layout the ISA reruns check
# (`serving/test_engine.py`, `test_architectures.py`). A server test with arithmetic of its own (chunked prefill)
# carries the mark itself.
_NOT_NUMERICS_DIRS = (("serving", "frontend"),)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "numerics: asserts a numerical equality that depends on the CPU's kernels "
                                       "(run again under each ISA by scripts/numerics_under_isas.py)")
    _share_the_cores(os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
    try:
        required_names()
    except ValueError as exc:  # a misspelt name would silently require nothing
        raise pytest.UsageError(str(exc)) from None


def _share_the_cores(workers: str | None) -> None:
    """A pytest-xdist worker computes in-process on its share of the cores, not on all of them.

    torch starts one intra-op thread per core in every process; two workers on two cores then run four threads, and
    each OpenMP barrier spins while the other worker holds a core: the runtime's and the engine's numerics tests
    took 51 s of wall and 102 s of CPU against 34 s and 70 s with a thread each (AMD EPYC, 2 cores, avx2). The
    processes a test starts (ranks, servers, workers) set their own threads, as they do for a user.
    """
    if workers is None or int(workers) < 2:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // int(workers)))


def pytest_report_header(config: pytest.Config) -> str:
    names = sorted(required_names())
    return f"{ENV_VAR}: {', '.join(names) if names else 'nothing (missing dependencies skip)'}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        try:
            path = item.path.relative_to(here)
        except ValueError:
            continue
        # Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), tests that share a machine-wide
        # resource run on one worker, one after another: the one-node Slurm cluster (one per worker would clash
        # on the node), and network namespaces (their tests check that none is left but the ones they found).
        # Tests that share a module- or class-scoped fixture (a launched check run, a started server) run on one
        # worker too, so it is built once.
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.get_closest_marker("netns") is not None:
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif (shared := _shared_fixtures(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(f"{path.as_posix()}:{shared}"))
        if (path.parts[0] in _NUMERICS_DIRS and path.parts[:2] not in _NOT_NUMERICS_DIRS
                and _NUMERICS_NAME.search(item.name)):
            item.add_marker(pytest.mark.numerics)


def _shared_fixtures(item: pytest.Item) -> str | None:
    """None where `item` uses no module- or class-scoped fixture; else the parameters of those that have one
    ("name=param,...", "" for none): one group per instance, so a file's tests that share one stay together."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    names = sorted(name for name, defs in info.name2fixturedefs.items() if defs[-1].scope in ("module", "class"))
    if not names:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    return ",".join(f"{name}={params[name]}" for name in names if name in params)


@pytest.fixture(scope="session", autouse=True)
def shared_zygotes() -> Iterator[None]:
    """This pytest process's zygote directory, shared with the commands its tests start (see the module
    docstring); none where `MBRIDGE_EPOVERLAP_ZYGOTE=0`."""
    from mbridge_epoverlap.launch import zygote

    if not zygote.enabled():
        yield
        return
    directory = Path(tempfile.mkdtemp(prefix="mbe-zygotes-"))
    zygote.share(directory)
    try:
        yield
    finally:
        zygote.stop_shared(directory)
        shutil.rmtree(directory, ignore_errors=True)
