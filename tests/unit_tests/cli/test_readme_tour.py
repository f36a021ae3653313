"""The README's five-minute tour, run as written in a fresh copy of the repository.

The tracked files are copied into a temporary folder (what a fresh clone holds: no results, no
traces), and every command of the tour's fenced blocks runs there in order, as a new user would run
it. The only change is the one the README itself offers for a quicker look: the A/B runs one repeat
of a few iterations (`--repeats`, `-ms`). Step 3 reads the traces step 1 wrote, at the folders step 1
printed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit_tests.cli_runner import REPO

# The quicker look the README offers for step 1: "lower --repeats and add -ms 4".
QUICK_REPEATS = "1"
QUICK_STEPS = "1"
_FENCE = re.compile(r"^```bash\n(.*?)^```", re.DOTALL | re.MULTILINE)


def tour_commands(readme: str) -> list[str]:
    """The shell commands of the tour section's bash blocks, in order."""
    start = readme.index("## Five-minute tour")
    end = readme.index("\n## ", start + 1)
    section = readme[start:end]
    return [line.strip() for block in _FENCE.findall(section) for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked files (as in the working tree) copied to `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def argv_of(command: str) -> list[str]:
    """A tour command as this interpreter runs it (`python` and `mbridge-epoverlap` from this venv; `curl`
    only for the server step)."""
    tokens = shlex.split(command)
    if tokens[0] == "python":
        return [sys.executable, *tokens[1:]]
    if tokens[0] == "mbridge-epoverlap":
        return [sys.executable, "-m", "mbridge_epoverlap.cli", *tokens[1:]]
    if tokens[0] == "curl":
        return tokens
    raise AssertionError(f"the tour runs python, mbridge-epoverlap and curl only, not {tokens[0]!r}")


class TourServer:
    """The server step (`serve --http`): started as a second terminal would, stopped (it drains) at the end."""

    READY_S = 300.0

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        import threading

        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                if "ready at http://" in line:
                    self.ready.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not self.ready.wait(self.READY_S):
            self.stop()
            raise AssertionError("the tour's server did not get ready:\n" + "".join(self.lines))

    def stop(self) -> int:
        from mbridge_epoverlap.launch.signals import stop_gracefully

        return stop_gracefully(self.proc, 120)


def quicker(argv: list[str]) -> list[str]:
    """Step 1 with the README's own shortening: fewer repeats, fewer iterations."""
    out = list(argv)
    if "--repeats" in out:
        out[out.index("--repeats") + 1] = QUICK_REPEATS
    return [*out, "-ms", QUICK_STEPS]


@pytest.mark.timeout(900)  # six short training launches; minutes only on a crowded machine
def test_the_readme_tour_runs_as_written_from_a_fresh_copy(tmp_path: Path):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "-ms 4" in readme and "--repeats" in readme, "the README offers the quicker look this test takes"
    checkout = fresh_copy(tmp_path / "checkout")
    # The server measures its layout and caches the choice: in this test's own directory, not the user's.
    env = dict(os.environ, PYTHONPATH=str(checkout), COLUMNS="200", XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("MBRIDGE_EPOVERLAP_FAULT", None)
    commands = tour_commands(readme)
    assert len(commands) >= 6
    printed = ""
    server: TourServer | None = None
    try:
        for command in commands:
            if " --http " in command:  # the server step: it serves until stopped, the next step talks to it
                server = TourServer(argv_of(command), checkout, env)
            else:
                printed = run_step(command, checkout, env, printed)
    finally:
        if server is not None:
            assert server.stop() == 0, "".join(server.lines)
    assert server is not None and "layout (measured; no layout flag given" in "".join(server.lines)


def run_step(command: str, checkout: Path, env: dict[str, str], printed: str) -> str:
    """Run one tour command and check it; returns what step 1 printed (once step 1 ran, else `printed`)."""
    argv = argv_of(command)
    if "run_script.py" in command:
        argv = quicker(argv)
    result = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    shown = f"$ {command}\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, shown
    assert "Traceback" not in shown
    if "run_script.py" in command:
        printed = result.stdout
        assert str(checkout) in printed, "the A/B ran the copy's code and wrote into the copy"
        # -ms 1 clips the stable window 3:8; the user is told once, under the table.
        assert shown.count("does not fit --max_steps") == 1, shown
    if command.startswith("mbridge-epoverlap profile results/"):
        # Step 3 reads exactly the folders step 1 printed.
        for folder in shlex.split(command)[2:4]:
            assert folder in printed, f"step 1 did not print {folder}"
            assert list((checkout / folder).glob("rank*.json")), folder
        assert "before -> after" in result.stdout
    if "--png" in command:
        png = shlex.split(command)[shlex.split(command).index("--png") + 1]
        assert (checkout / png).is_file()
    if command.startswith("curl"):  # the server step's completion
        assert '"object":"text_completion"' in result.stdout, shown
    return printed


def test_tour_commands_are_found():
    commands = tour_commands((REPO / "README.md").read_text(encoding="utf-8"))
    assert commands[0].startswith("python scripts/performance/run_script.py") and "--profile" in commands[0]
    assert any(c.startswith("mbridge-epoverlap profile results/") for c in commands)


if __name__ == "__main__":  # pragma: no cover - a manual run
    sys.exit(pytest.main([__file__, "-q"]))
