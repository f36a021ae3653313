"""Two emulated hosts (`launch_processes(emulate_hosts=...)`): ranks of a host share its network namespace and
address, only traffic between hosts crosses the shaped link, a replacement starts in its host's namespace, and
nothing is left behind. Real processes; needs root and iproute2."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.launch import launch_processes
from mbridge_epoverlap.launch.netns import EmulatedLink, existing_namespaces
from tests.unit_tests.requirements import require_or_skip

pytestmark = pytest.mark.timeout(240)

# Each process writes its namespace, M2N host and generation; rank 3 fails at first (it is expendable), its
# replacement writes too; the others wait for the replacement's file (the launcher's timeout bounds the wait).
REPORT = (
    "import json, os, sys, time\n"
    "rank, gen = int(os.environ['RANK']), int(sys.argv[1])\n"
    "out = os.path.join(sys.argv[2], f'rank{rank}.g{gen}.json')\n"
    "json.dump({'ns': os.readlink('/proc/self/ns/net'), 'host': os.environ.get('MBRIDGE_EPOVERLAP_M2N_HOST')},"
    " open(out, 'w'))\n"
    "if rank == 3 and gen == 0: sys.exit(3)\n"
    "while rank != 3 and not os.path.exists(os.path.join(sys.argv[2], 'rank3.g1.json')): time.sleep(0.05)\n"
)


@pytest.mark.netns
def test_ranks_share_their_hosts_namespace_and_a_replacement_starts_in_it(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        require_or_skip("netns", "link emulation needs root and iproute2 (ip, tc)")
    before = set(existing_namespaces())
    result = launch_processes(4, lambda rank: [sys.executable, "-c", REPORT, "0", str(tmp_path)],
                              collect=lambda workdir: {}, expendable=[3], emulate_link_gbps=1.0,
                              emulate_hosts=[0, 0, 1, 1], timeout_s=60,
                              respawn=lambda rank, gen: [sys.executable, "-c", REPORT, str(gen), str(tmp_path)])
    assert result["lost_ranks"] == [3]
    seen = {name.stem: json.loads(name.read_text()) for name in tmp_path.glob("rank*.json")}
    assert sorted(seen) == ["rank0.g0", "rank1.g0", "rank2.g0", "rank3.g0", "rank3.g1"]
    ns = {key: value["ns"] for key, value in seen.items()}
    assert ns["rank0.g0"] == ns["rank1.g0"] != ns["rank2.g0"] == ns["rank3.g0"] == ns["rank3.g1"]
    assert ns["rank0.g0"] != os.readlink("/proc/self/ns/net")
    hosts = {key: value["host"] for key, value in seen.items()}
    assert hosts["rank0.g0"] == hosts["rank1.g0"] != hosts["rank2.g0"] == hosts["rank3.g1"]
    assert hosts["rank0.g0"].startswith(("198.18.", "198.19."))
    assert set(existing_namespaces()) <= before  # everything removed (a stale one may be swept meanwhile)


def test_emulated_hosts_must_cover_every_rank() -> None:
    with pytest.raises(UsageError, match="give each of the 3 ranks a host"):
        EmulatedLink(3, 1.0, [0, 1])
    with pytest.raises(UsageError, match="numbered from 0"):
        EmulatedLink(2, 1.0, [1, 2])
