"""An emulated inter-node link: each rank in its own network namespace, joined by a bridge, every link
shaped to G Gbit/s with a token-bucket filter (netem is not available everywhere; tbf is).

    rank r: netns mbe-<id>-r<r>, interface ep0 = 198.{18|19}.X.(r+1)/24
            ep0 (tbf, rank's egress) <-veth-> mbe<id>h<r> (tbf, rank's ingress) -- bridge mbe<id>br

Addresses come only from 198.18.0.0/15 (reserved for benchmarking); the namespaces have no route
beyond their /24, so no packet can leave the bridge. Names carry a random run id, so concurrent runs do
not collide; a registry under /run lets a later run remove what a killed run left behind. Needs root.

With `hosts` (the emulated host of each rank), a namespace stands for a host instead: its ranks share it
(and its address; they talk to each other over its loopback), and only traffic between hosts crosses the
shaped links (`mbe-<id>-h<h>`, address .(h+1)).

With `gateway`, the bridge itself gets the address .254 in the root namespace: a process outside every
namespace (the online server's front end) binds there and the ranks reach it, across their shaped links,
as if it were one more host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from types import TracebackType

from mbridge_epoverlap.errors import RunFailedError, UsageError
from mbridge_epoverlap.launch.signals import pid_alive

logger = logging.getLogger(__name__)

IFNAME = "ep0"
REGISTRY = Path("/run/mbridge_epoverlap/links")
_MAX_RANKS = 254


def check_can_emulate() -> None:
    """Raise UsageError unless this process can create namespaces and shape links."""
    if os.geteuid() != 0:
        raise UsageError("--emulate-link-gbps needs root (it creates network namespaces and tc qdiscs); "
                         "run as root or drop the option")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise UsageError(f"--emulate-link-gbps needs the `{tool}` command; install iproute2 "
                             "(apt-get install -y iproute2) or drop the option")


class EmulatedLink:
    """Namespaces, veths and a bridge for `world` ranks, shaped to `gbps`; a context manager that removes
    everything it created on exit.

    Args:
        world: number of ranks (one namespace each, unless `hosts`).
        gbps: link rate in Gbit/s (each namespace's sending and receiving are each limited to it).
        hosts: the emulated host (0, 1, ...) of each rank: one namespace per host (None: one per rank).
        gateway: give the bridge the address `gateway_address` in the root namespace.
    """

    def __init__(self, world: int, gbps: float, hosts: list[int] | None = None, *, gateway: bool = False) -> None:
        if gbps <= 0:
            raise UsageError(f"--emulate-link-gbps {gbps}: the rate must be positive")
        if not 1 <= world <= _MAX_RANKS:
            raise UsageError(f"--emulate-link-gbps supports 1..{_MAX_RANKS} ranks, not {world}")
        if hosts is not None and (len(hosts) != world or sorted(set(hosts)) != list(range(max(hosts) + 1))):
            raise UsageError(f"emulated hosts {hosts}: give each of the {world} ranks a host, numbered from 0")
        self.world, self.gbps = world, gbps
        self.hosts = list(hosts) if hosts is not None else list(range(world))
        nodes = max(self.hosts) + 1
        kind = "r" if hosts is None else "h"
        self.run_id = secrets.token_hex(3)
        subnet = int(self.run_id, 16) % 512
        self._prefix = f"198.{18 + subnet // 256}.{subnet % 256}"
        self.bridge = f"mbe{self.run_id}br"
        self.namespaces = [f"mbe-{self.run_id}-{kind}{n}" for n in range(nodes)]
        self.host_links = [f"mbe{self.run_id}h{n}" for n in range(nodes)]
        self.gateway = gateway
        self._created = False

    @property
    def gateway_address(self) -> str:
        """The bridge's address in the root namespace (with `gateway`): where a process outside the namespaces
        listens for the ranks."""
        if not self.gateway:
            raise ValueError("this link has no gateway address (create it with gateway=True)")
        return f"{self._prefix}.254"

    def address(self, rank: int) -> str:
        """Rank `rank`'s IPv4 address (on interface `IFNAME` inside its namespace)."""
        return self._node_address(self.hosts[rank])

    def _node_address(self, node: int) -> str:
        return f"{self._prefix}.{node + 1}"

    def command_prefix(self, rank: int) -> list[str]:
        """Prepend to a command to run it inside rank `rank`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[self.hosts[rank]]]

    def __enter__(self) -> EmulatedLink:
        self.create()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()

    def create(self) -> None:
        """Build the namespaces, links, bridge and shaping (removing everything again if a step fails)."""
        check_can_emulate()
        sweep_stale()
        self._register()
        self._created = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _no_ipv6(self.bridge)
            if self.gateway:
                _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            rate, burst = _tbf_params(self.gbps)
            for node, (ns, host) in enumerate(zip(self.namespaces, self.host_links, strict=True)):
                peer = f"mbe{self.run_id}n{node}"
                _ip("netns", "add", ns)
                _ip("link", "add", host, "type", "veth", "peer", "name", peer)
                _no_ipv6(host)
                _ip("link", "set", peer, "netns", ns)
                _ip("-n", ns, "link", "set", peer, "name", IFNAME)
                _run(["ip", "netns", "exec", ns, "sh", "-c",
                      "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                      f"echo 1 > /proc/sys/net/ipv6/conf/{IFNAME}/disable_ipv6"], check=False)
                _ip("-n", ns, "addr", "add", f"{self._node_address(node)}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", IFNAME, "up")
                _ip("link", "set", host, "master", self.bridge)
                _ip("link", "set", host, "up")
                tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", "50ms"]
                _run(["tc", "qdisc", "replace", "dev", host, *tbf])
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", IFNAME, *tbf])
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Delete everything this link created; never raises."""
        if not self._created:
            return
        _remove_resources(self.namespaces, [*self.host_links, self.bridge])
        _registry_file(self.run_id).unlink(missing_ok=True)
        self._created = False

    def _register(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "namespaces": self.namespaces, "links": [*self.host_links, self.bridge]}
        _registry_file(self.run_id).write_text(json.dumps(record))


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of runs whose launcher process is gone; return their run ids."""
    removed = []
    if not REGISTRY.is_dir():
        return removed
    for path in REGISTRY.glob("*.json"):
        try:
            record = json.loads(path.read_text())
            pid = int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid_alive(pid):
            continue
        _remove_resources(list(record.get("namespaces", [])), list(record.get("links", [])))
        path.unlink(missing_ok=True)
        removed.append(path.stem)
    return removed


def existing_namespaces(prefix: str = "mbe-") -> list[str]:
    """Network namespaces whose name starts with `prefix` (what tests check is gone)."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _registry_file(run_id: str) -> Path:
    return REGISTRY / f"{run_id}.json"


def _tbf_params(gbps: float) -> tuple[str, str]:
    rate_kbit = max(int(round(gbps * 1e6)), 8)
    # A burst of about a millisecond at line rate (at least 64 KiB so a GSO segment fits): large enough
    # for tbf to reach its rate, small next to the hundreds of KiB one all-to-all moves.
    burst = max(rate_kbit * 1000 // 8 // 1000, 64 * 1024)
    return f"{rate_kbit}kbit", str(burst)


def _remove_resources(namespaces: list[str], links: list[str]) -> None:
    present = set(existing_namespaces(prefix=""))
    for ns in namespaces:
        if ns in present:
            _run(["ip", "netns", "del", ns], check=False)
    for link in links:
        if Path("/sys/class/net", link).exists():
            _run(["ip", "link", "del", link], check=False)


def _no_ipv6(link: str) -> None:
    """Keep the host from giving `link` an IPv6 address or sending neighbour discovery on it."""
    with contextlib.suppress(OSError):  # no IPv6 on this host: nothing to disable
        Path(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6").write_text("1")




def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(cmd: list[str], *, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RunFailedError(f"link emulation: `{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    if proc.returncode != 0:
        logger.debug("`%s` failed: %s", " ".join(cmd), proc.stderr.strip())
    return proc.stdout
