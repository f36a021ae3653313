"""Skips for a missing dependency, which `MBRIDGE_EPOVERLAP_REQUIRE` turns into failures.

Some tests need what a plain `pip install` does not guarantee: a pip package that may fail to import
(Mooncake's Transfer Engine needs Debian's libibverbs1), system packages (Slurm and munge, iproute2),
root. Without them such a test skips with the reason. Where the dependency is supposed to be there
(CI installs all of them, see `.ci/run`), a skip would hide a broken install, so the variable names the
dependencies that must be present: a test that would skip for one of them fails instead.

    MBRIDGE_EPOVERLAP_REQUIRE=mooncake,netns   # comma-separated names from REQUIREMENTS
    MBRIDGE_EPOVERLAP_REQUIRE=all              # every one of them

Every skip for a missing dependency goes through `require_or_skip` (or `import_or_skip`); skips for
other reasons (a test that does not apply where a GPU is present, say) stay plain `pytest.skip`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from types import ModuleType
from typing import NoReturn

import pytest

ENV_VAR = "MBRIDGE_EPOVERLAP_REQUIRE"

# name -> what it stands for (and what installs it), as the failure message shows it.
REQUIREMENTS: dict[str, str] = {
    "mooncake": "the Mooncake Transfer Engine (pip mooncake-transfer-engine-non-cuda, Debian libibverbs1)",
    "netns": "network namespaces for the emulated link (root, Debian iproute2: ip, tc)",
    "slurm": "a private one-node Slurm cluster (root, Debian slurm-wlm and munge)",
    "megatron_core": "Megatron-Core (pip megatron-core, a dependency of the package)",
    "bridge": "the Python 3.12 environment with Megatron-Bridge 0.6.2 named by MBRIDGE_EPOVERLAP_BRIDGE_PYTHON "
              "(scripts/setup_bridge_venv.sh builds it)",
    "bridge_main": "the Python 3.12 environment with Megatron-Bridge main named by "
                   "MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON (scripts/setup_bridge_main_venv.sh builds it from the "
                   "sources of both mains)",
}


def required_names(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The names `MBRIDGE_EPOVERLAP_REQUIRE` asks for (`all`: every name in REQUIREMENTS).

    Raises:
        ValueError: a name that is not in REQUIREMENTS (a typo would otherwise require nothing).
    """
    text = (os.environ if env is None else env).get(ENV_VAR, "")
    names = {name.strip() for name in text.split(",") if name.strip()}
    if "all" in names:
        return frozenset(REQUIREMENTS)
    unknown = sorted(names - set(REQUIREMENTS))
    if unknown:
        raise ValueError(f"{ENV_VAR}={text!r}: unknown name(s) {', '.join(unknown)}; "
                         f"use a comma-separated list of {', '.join(REQUIREMENTS)}, or all")
    return frozenset(names)


def require_or_skip(name: str, reason: str) -> NoReturn:
    """Skip the calling test because dependency `name` is missing, or fail it where it is required."""
    if name not in REQUIREMENTS:
        raise ValueError(f"unknown requirement {name!r}: add it to REQUIREMENTS in {__name__}")
    if name in required_names():
        pytest.fail(f"{reason}\n{ENV_VAR} requires {name!r}: {REQUIREMENTS[name]}; install it, or leave "
                    f"{name!r} out of {ENV_VAR} to skip", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def import_or_skip(module: str, name: str) -> ModuleType:
    """`importlib.import_module(module)`, or `require_or_skip(name, ...)` when it does not import."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        require_or_skip(name, f"{module} does not import ({exc})")
