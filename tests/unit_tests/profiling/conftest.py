"""Shared fixtures of the profile analyzer tests: unpacked public traces, synthetic trace builders."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """Folder of the stored test traces."""
    return DATA


@pytest.fixture(scope="session")
def nsys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stored Nsight Systems exports, unpacked (SQLite needs a plain file)."""
    out = tmp_path_factory.mktemp("nsys")
    for packed in sorted((DATA / "nsys").glob("*.sqlite.gz")):
        with gzip.open(packed, "rb") as src, open(out / packed.name[: -len(".gz")], "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out
