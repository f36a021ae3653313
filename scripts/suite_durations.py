#!/usr/bin/env python3
"""Where `make test`'s time goes: every test's and every fixture's wall and CPU seconds, the slowest first.

Runs pytest (the suite, or the paths and flags given after `--`) with a small plugin in each pytest process
(xdist workers included) that times each test's setup, call and teardown, and each fixture's setup, in wall
seconds and in CPU seconds: the process's own and its reaped children's (the worker processes, servers and
training ranks a test starts and waits for, those its zygote forked included: `launch.zygote`), so a test that
waits on a timeout shows wall without CPU. Ranks that a test's own subprocess (a CLI, a server) started count
when that subprocess exits.

    python scripts/suite_durations.py                         # the whole suite as `make test` runs it
    python scripts/suite_durations.py --top 40 -- tests/unit_tests/serving -n 2
    python scripts/suite_durations.py --json durations.json   # every record, for a before/after comparison

Prints two markdown tables (tests: setup + call + teardown; fixtures: their setup, each instance once) and the
sums; exit status is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTEST_ARGS = ["-n", "2", "--dist", "loadgroup", "tests"]
OUT_VAR = "MBRIDGE_EPOVERLAP_DURATIONS_DIR"


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    # Ranks forked by this process's zygote are the zygote's children: it reports their CPU as each exits.
    zygote = sys.modules.get("mbridge_epoverlap.launch.zygote")
    forked = zygote.forked_cpu_seconds() if zygote is not None else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


class DurationsPlugin:
    """Loaded in each pytest process (`-p`): records (kind, name, phase, wall, cpu) and writes them at the end."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.records = out_dir, []

    def _timed(self, kind: str, name: str, phase: str):
        wall, cpu = time.perf_counter(), _cpu_seconds()
        yield
        self.records.append({"kind": kind, "name": name, "phase": phase, "wall_s": time.perf_counter() - wall,
                             "cpu_s": _cpu_seconds() - cpu})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: Any):
        yield from self._timed("test", item.nodeid, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: Any):
        yield from self._timed("test", item.nodeid, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: Any):
        yield from self._timed("test", item.nodeid, "teardown")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any):
        param = getattr(request, "param", None)
        name = fixturedef.argname + (f"[{param}]" if param is not None else "")
        yield from self._timed("fixture", f"{name} ({fixturedef.scope})", "setup")

    def pytest_sessionfinish(self, session: Any) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(self.out_dir, f"{worker}-{os.getpid()}.json").write_text(json.dumps(self.records))


def pytest_configure(config: Any) -> None:
    """The plugin's entry when pytest loads this file with `-p`."""
    out_dir = os.environ.get(OUT_VAR)
    if out_dir:
        config.pluginmanager.register(DurationsPlugin(out_dir), "mbe-durations")


def tables(records: list[dict[str, Any]], top: int) -> str:
    tests: dict[str, dict[str, float]] = {}
    fixtures: dict[str, dict[str, float]] = {}
    for r in records:
        into = tests if r["kind"] == "test" else fixtures
        row = into.setdefault(r["name"], {"wall_s": 0.0, "cpu_s": 0.0, "count": 0})
        row["wall_s"] += r["wall_s"]
        row["cpu_s"] += r["cpu_s"]
        row["count"] += r["phase"] == "setup"
    out = []
    for title, rows in (("tests (setup + call + teardown)", tests), ("fixtures (setup)", fixtures)):
        ranked = sorted(rows.items(), key=lambda kv: -kv[1]["wall_s"])
        out.append(f"\n{title}: {len(rows)}, {sum(v['wall_s'] for v in rows.values()):,.0f} s wall, "
                   f"{sum(v['cpu_s'] for v in rows.values()):,.0f} s CPU\n")
        out.append("| wall s | CPU s | CPU / wall | name |\n|---:|---:|---:|---|")
        for name, v in ranked[:top]:
            ratio = v["cpu_s"] / v["wall_s"] if v["wall_s"] > 0 else 0.0
            out.append(f"| {v['wall_s']:.1f} | {v['cpu_s']:.1f} | {ratio:.2f} | `{name}` |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = DEFAULT_PYTEST_ARGS
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=20, help="rows per table (default 20)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every record here")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error("--top must be at least 1")
    with tempfile.TemporaryDirectory(prefix="mbe-durations-") as out_dir:
        env = {**os.environ, OUT_VAR: out_dir, "PYTHONPATH": os.pathsep.join(filter(None, [
            str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]))}
        started = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_durations", *pytest_args],
                              cwd=ROOT, env=env).returncode
        wall = time.perf_counter() - started
        records = [r for path in sorted(Path(out_dir).glob("*.json")) for r in json.loads(path.read_text())]
    print(tables(records, args.top))
    print(f"\npytest ran {wall:,.0f} s wall; exit status {code}")
    if args.json is not None:
        args.json.write_text(json.dumps({"wall_s": wall, "records": records}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
