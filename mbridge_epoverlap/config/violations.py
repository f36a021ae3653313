"""Validation results: one `Violation` per broken rule, and the error that carries all of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Violation:
    """A broken rule.

    Attributes:
        rule: stable rule id (see `mbridge_epoverlap.config.rules.all_rules()`).
        message: what is wrong, naming the settings and their values.
        fix: what to change, as overrides or flags a user can paste.
        severity: "error" (the job would fail or misbehave) or "warning" (known-bad, but the targeted
            Megatron-Core does not reject it, or the outcome depends on something unknown here).
    """

    rule: str
    message: str
    fix: str
    severity: Severity = "error"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def errors_of(violations: list[Violation]) -> list[Violation]:
    return [v for v in violations if v.severity == "error"]


class ConfigValidationError(ValueError):
    """Raised by `CommOverlapConfig.finalize` with every error found, not just the first."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        lines = [f"{len(self.violations)} EP-overlap configuration error(s):"]
        for v in self.violations:
            lines.append(f"  [{v.rule}] {v.message}\n      fix: {v.fix}")
        super().__init__("\n".join(lines))
