"""Session-wide checks of the unit tests: the dependencies `MBRIDGE_EPOVERLAP_REQUIRE` names (see `requirements`)."""

from __future__ import annotations

import pytest

from tests.unit_tests.requirements import ENV_VAR, required_names


def pytest_configure(config: pytest.Config) -> None:
    try:
        required_names()
    except ValueError as exc:  # a misspelt name would silently require nothing
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    names = sorted(required_names())
    return f"{ENV_VAR}: {', '.join(names) if names else 'nothing (missing dependencies skip)'}"
