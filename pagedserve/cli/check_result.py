"""What one `pagedserve doctor` check says: PASS, WARN or FAIL, what it saw, and the fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # PASS, WARN or FAIL
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)
