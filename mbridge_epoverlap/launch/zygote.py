"""Start local ranks by forking them from a process that imported torch once (`Zygote`), not as new interpreters.

A rank started as `python -m module ...` spends ~1.5 s of CPU importing torch before its first line of work
(`python -X importtime -c "import torch"`: torch._C, its decompositions and meta registrations), as much as a
short run's arithmetic on a 2-core machine; a launcher that starts several ranks, replacements (elastic
serving's expert workers), or run after run (an A/B's cases, a test suite) pays it every time. The zygote pays it
once: it starts with the ranks' environment, imports torch, and for each rank forks a child that takes the rank's
own session, output files, inherited sockets, working directory, environment and argv, names itself after them
(`setproctitle`, as `ps` shows a fresh process) and runs the module as `python -m` would, exit code included.

The child computes as a fresh process does: the zygote runs no kernel, so no thread pool, kernel choice or
generator state is inherited, and the environment variables torch and its math libraries read at import
(`IMPORT_SENSITIVE`) must equal the zygote's, else the rank starts as a new interpreter (so does a command that
is not `python -m` with this interpreter, or one behind a network namespace's `ip netns exec`). Exit codes come
back over the control socket (a process the zygote forked is the zygote's child, not the launcher's); a
launcher's zygotes leave with it (the socket's end closes) and `MBRIDGE_EPOVERLAP_ZYGOTE=0` turns them off. A child
maps the file pages the zygote has resident before it runs, so its resident set starts where a new interpreter's
does (the memory report's runtime). Launchers of one environment can share zygotes through a directory (`share`,
`ZYGOTE_DIR_ENV`): the test suite does, so that the servers and harness runs its tests start fork their workers
from a zygote that is already up.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ZYGOTE_ENV = "MBRIDGE_EPOVERLAP_ZYGOTE"  # "0": every rank starts as a new interpreter
# A directory of zygotes shared by every launcher that has it in its environment (`share`; the test suite's, one per
# pytest worker): one per environment, each listening at `<hash of its environment>.sock`, started by the first
# launcher that needs it and living as long as the process that made the directory (its pid in `owner`).
ZYGOTE_DIR_ENV = "MBRIDGE_EPOVERLAP_ZYGOTE_DIR"
# What torch, its OpenMP and math libraries, the allocator and the interpreter read from the environment when torch
# is imported: a rank whose values differ from the zygote's would not compute as it was asked to.
IMPORT_SENSITIVE = ("OMP_", "GOMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH", "PYTORCH_", "OPENBLAS_",
                    "LD_", "MALLOC_", "GLIBC_", "PYTHON", "CUDA_", "NCCL_", "XDG_CACHE_HOME")
# Signals a rank's launcher may ignore (an xdist worker ignores SIGINT, `nohup` SIGHUP), which its ranks then ignore.
INHERITED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
READY_TIMEOUT_S = 120.0  # a zygote that has not imported torch by then is given up (the ranks start fresh)
REPLY_TIMEOUT_S = 30.0  # the zygote answers a fork with the child's pid
MAX_MESSAGE = 1 << 20
_FDS_PER_REQUEST = 8


def enabled() -> bool:
    return os.environ.get(ZYGOTE_ENV, "1") != "0"


def import_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of `env` a forked rank inherits from its zygote's import instead of reading it itself."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_SENSITIVE)))


class ZygoteProcess:
    """A rank the zygote forked, seen as `subprocess.Popen` shows one: `pid`, `returncode`, `poll`, `wait`."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = self.zygote.exit_code(self.pid, min(left, 1.0))
        return self.returncode


class Zygote:
    """One zygote: a process this launcher starts with `env` (see the module docstring), or, with `connect`, a
    connection to one that listens in a shared directory (`ZYGOTE_DIR_ENV`). Started with `listen` and `owner`, the
    zygote also takes other launchers' requests at `listen` and lives until process `owner` exits, not this one."""

    def __init__(self, env: Mapping[str, str], *, listen: Path | None = None, owner: int | None = None) -> None:
        self.key = import_key(env)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - its own output, shown if it fails to start
        argv = [sys.executable, "-m", __name__, str(theirs.fileno())]
        if listen is not None:
            argv += [str(listen), str(owner or os.getpid())]
        self.shared = listen is not None
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        self._setup()
        ready = self._next(READY_TIMEOUT_S)
        if ready is None or not ready.get("ready"):
            self._log.seek(0)
            said = self._log.read()[-2000:].decode(errors="replace").strip()
            self.close()
            raise OSError(f"the zygote did not start: {said or 'no word within the time allowed'}")

    @classmethod
    def connect(cls, path: str) -> Zygote:
        """A connection to the zygote listening at `path`; its `key` is the environment it imported torch with."""
        self = cls.__new__(cls)
        self.proc, self._log, self.shared = None, None, True
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._setup()
        try:
            self._sock.settimeout(5.0)
            self._sock.connect(path)
            self._sock.settimeout(None)
        except OSError:
            self.close()
            raise
        hello = self._next(REPLY_TIMEOUT_S)
        if hello is None or not hello.get("ready"):
            self.close()
            raise OSError(f"no zygote answered at {path}")
        self.key = tuple((k, v) for k, v in hello["key"])
        return self

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._codes: dict[int, int] = {}
        self.alive = True

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], *, stdout: IO[bytes], stderr: IO[bytes],
              pass_fds: Sequence[int] = (), cwd: str | None = None) -> ZygoteProcess:
        """Fork `argv` (`[sys.executable, "-m", module, ...]`) in its own session; `pass_fds` keep their numbers."""
        # A new interpreter keeps the signals its launcher ignores ignored (exec keeps them so), whatever the
        # zygote had when it started.
        ignored = [int(sig) for sig in INHERITED_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN]
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(), "pass_fds": list(pass_fds),
                   "ignored": ignored}
        fds = [stdout.fileno(), stderr.fileno(), *pass_fds]
        with self._lock:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while True:
                reply = self._read_locked(max(0.0, deadline - time.monotonic()))
                if reply is None:
                    raise OSError("the zygote did not answer a start")
                if "pid" in reply or "error" in reply:
                    break
        if "error" in reply:
            raise OSError(f"the zygote could not start {argv[2] if len(argv) > 2 else argv}: {reply['error']}")
        return ZygoteProcess(self, int(reply["pid"]), argv)

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """`pid`'s exit code (negative: the signal that ended it) once the zygote reported it, waiting up to
        `timeout`; a process that ended while the zygote was gone has exit code 1."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._codes:
                if not self.alive:
                    if ended(pid):
                        self._codes[pid] = 1
                    break
                if self._read_locked(max(0.0, deadline - time.monotonic())) is None:
                    if timeout <= 0 and ended(pid):  # a zombie the zygote is reaping now: its word is near
                        deadline = time.monotonic() + 2.0
                        timeout = 2.0
                        continue
                    break
            return self._codes.get(pid)

    def _read_locked(self, timeout: float) -> dict[str, Any] | None:
        """The next message that is not an exit report (those are recorded), or None after `timeout`."""
        while self.alive:
            message = self._next(timeout)
            if message is None:
                return None
            if "exited" in message:
                self._codes[int(message["exited"])] = int(message["code"])
                _forked_cpu[0] += float(message.get("cpu_s", 0.0))
                timeout = 0.0
                continue
            return message
        return None

    def _next(self, timeout: float) -> dict[str, Any] | None:
        if not select.select([self._sock], [], [], max(0.0, timeout))[0]:
            return None
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except OSError:
            data = b""
        if not data:  # the zygote is gone
            self.alive = False
            return None
        return json.loads(data)

    def close(self) -> None:
        """End the zygote this launcher started (its ranks go on; their launchers supervise them), or this
        connection to another's."""
        self.alive = False
        with contextlib.suppress(OSError):
            self._sock.close()
        if self.proc is not None and not self.shared:  # a shared one leaves with its owner
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=5.0)
        if self._log is not None:
            self._log.close()


def ended(pid: int) -> bool:
    """`pid` has exited (a zombie, or gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


_forked_cpu = [0.0]  # CPU seconds of this launcher's forked ranks that have exited and been reported


def forked_cpu_seconds() -> float:
    """CPU seconds the ranks this process's zygotes forked spent, once they exited: what `RUSAGE_CHILDREN` would
    have counted had this process started them itself."""
    return _forked_cpu[0]


_ZYGOTES: dict[tuple[tuple[str, str], ...], Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()
_FAILED: set[tuple[tuple[str, str], ...]] = set()


def zygote_for(argv: Sequence[str], env: Mapping[str, str]) -> Zygote | None:
    """This launcher's zygote for a rank `argv` with `env` (started at the first such rank), or None where the rank
    must start as a new interpreter: turned off, not `python -m` with this interpreter, or the zygote failed."""
    if not enabled() or len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        return None
    key = import_key(env)
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is not None and not zygote.alive:
            zygote = _ZYGOTES.pop(key)
            zygote.close()
            zygote = None
        directory = os.environ.get(ZYGOTE_DIR_ENV)
        if zygote is None and directory and key not in _FAILED:
            zygote = _shared(Path(directory), key, env)
            if zygote is not None:
                _ZYGOTES[key] = zygote
        if zygote is None and key not in _FAILED:
            try:
                zygote = _ZYGOTES[key] = Zygote(env)
            except OSError as exc:
                _FAILED.add(key)
                print(f"mbridge-epoverlap: ranks start as new interpreters ({exc})", file=sys.stderr, flush=True)
        return zygote


def share(directory: Path) -> None:
    """Make `directory` (a private, empty one) the shared zygote directory (`ZYGOTE_DIR_ENV`) of this process and
    of the commands it starts; its zygotes live as long as this process."""
    (directory / "owner").write_text(str(os.getpid()))
    os.environ[ZYGOTE_DIR_ENV] = str(directory)


def stop_shared(directory: Path) -> None:
    """End the zygotes of a shared directory (their ranks go on) and forget it."""
    for pid_file in directory.glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
    if os.environ.get(ZYGOTE_DIR_ENV) == str(directory):
        del os.environ[ZYGOTE_DIR_ENV]


def _shared(directory: Path, key: tuple[tuple[str, str], ...], env: Mapping[str, str]) -> Zygote | None:
    """The shared directory's zygote for `key`: connected to, or started (listening there) by this launcher."""
    import hashlib

    path = directory / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16] + ".sock")
    try:
        owner = int((directory / "owner").read_text())
    except (OSError, ValueError):
        return None
    for _ in range(2):  # a zygote that another launcher starts at the same moment binds first: connect to it
        with contextlib.suppress(OSError):
            connection = Zygote.connect(str(path))
            if connection.key == key:
                return connection
            connection.close()
            return None
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket no zygote listens at any more
        try:
            return Zygote(env, listen=path, owner=owner)
        except OSError:
            continue
    return None


@atexit.register
def close_all() -> None:
    with _ZYGOTES_LOCK:
        for zygote in _ZYGOTES.values():
            zygote.close()
        _ZYGOTES.clear()


_title: Any = None  # the `setproctitle` module, in the zygote


# --- the zygote's side -----------------------------------------------------------------------------------------
class _Child(BaseException):
    """Raised in a forked child to leave the zygote's loop and run the rank at the top of the stack."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__()
        self.request = request


def _serve(control: socket.socket, listener: socket.socket | None, owner: int | None) -> None:
    """Fork a child for each request of the launcher (`control`) or of a launcher connected at `listener`; report
    each child's exit to the one that asked for it; return when the launcher that started this process is gone, or
    with `owner` (a pidfd) once that process is."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    hello = json.dumps({"ready": True, "key": import_key(os.environ)}).encode()
    control.send(hello)
    clients, owners = [control], {}  # owners: child pid -> the connection that asked for it
    while True:
        ready = select.select([*clients, wake_r, *([listener] if listener else []), *([owner] if owner else [])],
                              [], [])[0]
        if owner is not None and owner in ready:
            return
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(owners)
        if listener is not None and listener in ready:
            with contextlib.suppress(OSError):
                client, _ = listener.accept()
                client.send(hello)
                clients.append(client)
        for client in [c for c in clients if c in ready]:
            try:
                data, fds, _flags, _addr = socket.recv_fds(client, MAX_MESSAGE, _FDS_PER_REQUEST)
            except OSError:
                data, fds = b"", []
            if not data:
                if client is control and owner is None:
                    return
                clients.remove(client)
                client.close()
                continue
            request = json.loads(data)
            try:
                pid = os.fork()
            except OSError as exc:
                client.send(json.dumps({"error": str(exc)}).encode())
                pid = -1
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (wake_r, wake_w, *([owner] if owner else [])):
                    os.close(fd)
                # Through the objects: a bare close of a number would leave an object to close that number again
                # when collected, by then another file of the rank's (a gloo pipe, say).
                for sock in [*clients, *([listener] if listener else [])]:
                    sock.close()
                raise _Child({**request, "fds": fds})
            for fd in fds:
                os.close(fd)
            if pid > 0:
                owners[pid] = client
                with contextlib.suppress(OSError):
                    client.send(json.dumps({"pid": pid}).encode())


def _reap(owners: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        report = {"exited": pid, "code": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
        owner = owners.pop(pid, None)
        if owner is not None and owner.fileno() >= 0:  # its launcher may have gone since
            with contextlib.suppress(OSError):
                owner.send(json.dumps(report).encode())


def _map_the_zygotes_pages(zygote: int) -> None:
    """Map into this forked child the pages of files (torch's libraries, Python's modules) the zygote has resident.
    A fork copies the page tables of anonymous memory only; file pages are mapped as the child touches them, so a
    rank would start with a smaller resident set than a new interpreter's and grow into it while it computes, and
    what the memory report calls the runtime (the resident set before any weight) would be too small. Reading one
    byte of each such page (~20,000, a few tens of ms) gives the rank a new interpreter's resident set at its start.
    Best effort: where `/proc` says nothing, the rank starts as it is."""
    import ctypes

    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    try:
        # This process's own mappings (one the zygote marked not to be inherited is not here), the zygote's pages.
        with open("/proc/self/maps") as maps, open(f"/proc/{zygote}/pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split()
                # a readable mapping of a file (not anonymous memory, the stack or the vdso)
                if len(fields) < 6 or not fields[5].startswith("/") or not fields[1].startswith("r"):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                pagemap.seek(start // page * 8)
                entries = np.frombuffer(pagemap.read((end - start) // page * 8), dtype=np.uint64)
                for index in np.flatnonzero(entries >> np.uint64(63)):  # bit 63: the page is present
                    ctypes.string_at(start + int(index) * page, 1)
    except (OSError, ValueError):
        return


def _become(request: dict[str, Any]) -> None:
    """In the forked child: take the rank's session, files, sockets, directory, environment and name, then run its
    module as `python -m` does."""
    import runpy

    _map_the_zygotes_pages(os.getppid())
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for sig in INHERITED_SIGNALS:  # as a new interpreter started by the launcher has them
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if int(sig) in request["ignored"] else default)
    os.setsid()
    stdout, stderr, *passed = request["fds"]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    keep = {0, 1, 2}
    for fd, number in zip(passed, request["pass_fds"], strict=True):
        os.dup2(fd, number)  # the number the rank's environment names (`ranks.STORE_FD_ENV`)
        keep.add(number)
    for fd in {devnull, stdout, stderr, *passed} - keep:
        os.close(fd)
    argv = request["argv"]
    if _title is not None:  # before the environment changes: the title takes the memory argv and environ had
        _title.setproctitle(" ".join(argv))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *argv[3:]]  # the module's path replaces "-m", as `python -m` does
    sys.path[0] = request["cwd"]  # `python -m` puts its working directory first
    # The rank's own `__main__`, which lives until the interpreter exits (as a new interpreter's does: objects
    # in it, such as process groups, are not torn down before the exit handlers run).
    sys.modules["__main__"] = types.ModuleType("__main__")
    runpy._run_module_as_main(argv[2], alter_argv=True)  # what `python -m` runs


def main() -> None:
    global _title
    control = socket.socket(fileno=int(sys.argv[1]))
    try:
        import setproctitle

        setproctitle.getproctitle()  # finds the memory of argv and environ while both are as the kernel set them
        _title = setproctitle
    except ImportError:  # the ranks then show the zygote's command line in `ps`
        _title = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `stop_shared`: leave through the clean-up below
    listener = owner = None
    if len(sys.argv) > 3:  # shared: listen, and leave with the owner (gone already: leave now)
        try:
            owner = os.pidfd_open(int(sys.argv[3]))
        except ProcessLookupError:
            return
        # Bound before torch's import, so that a launcher arriving meanwhile waits for this one's word instead of
        # starting another; taken already, another launcher's zygote was first (this one's launcher sees the end).
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(sys.argv[2])
        listener.listen(64)
        Path(sys.argv[2]).with_suffix(".pid").write_text(str(os.getpid()))
    import torch  # noqa: F401 - the import every child would otherwise repeat

    try:
        _serve(control, listener, owner)
        return
    except _Child as child:
        request = child.request
    finally:
        if listener is not None and listener.fileno() >= 0:  # the zygote's own exit (a child closed its copy)
            listener.close()
            for path in (Path(sys.argv[2]), Path(sys.argv[2]).with_suffix(".pid")):
                with contextlib.suppress(OSError):
                    path.unlink()
    _become(request)  # outside the handler: the rank's own errors are not chained to the fork's exception


if __name__ == "__main__":
    main()
