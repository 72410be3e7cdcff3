"""Test-only fault injection: makes chosen engine stages raise for chosen requests (off unless configured).

A spec is a comma-separated list of rules `POINT:MATCH[:COUNT]`. POINT is where the fault fires: `add`
(LLMEngine.add_request), `schedule` (the scheduler, per request), `postprocess` (after the model step, per
request) or `step` (the model step, for the whole batch). MATCH is a substring of the request id (`*`:
any request). COUNT is how many times the rule fires (default: every time). Example: `step:*:1` fails
one model step, so the retry step succeeds; `step:*` fails every step, so the engine dies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.exceptions import InjectedFault

FAULT_POINTS = ("add", "schedule", "postprocess", "step")


@dataclass
class FaultRule:
    point: str
    match: str
    remaining: int | None  # None: fire every time

    def matches(self, point: str, request_ids: Iterable[str]) -> bool:
        if point != self.point or self.remaining == 0:
            return False
        return any(self.match == "*" or self.match in request_id for request_id in request_ids)


class FaultInjector:
    def __init__(self, spec: str | None = None) -> None:
        self.rules = parse_fault_spec(spec)

    def check(self, point: str, *request_ids: str) -> None:
        """Raise InjectedFault if a rule for `point` matches one of these requests."""
        for rule in self.rules:
            if rule.matches(point, request_ids):
                if rule.remaining is not None:
                    rule.remaining -= 1
                raise InjectedFault(f"injected fault at {point} for {', '.join(request_ids)}")


def parse_fault_spec(spec: str | None) -> list[FaultRule]:
    """Rules from a spec (see the module docstring); ValueError naming the bad rule."""
    rules = []
    for text in (spec or "").split(","):
        if not text.strip():
            continue
        parts = text.strip().split(":")
        if len(parts) not in (2, 3) or parts[0] not in FAULT_POINTS or not parts[1]:
            raise ValueError(f"--fault-injection rule {text!r} is not POINT:MATCH[:COUNT] with POINT one of "
                             f"{', '.join(FAULT_POINTS)}")
        if len(parts) == 3 and not parts[2].isdigit():
            raise ValueError(f"--fault-injection rule {text!r}: COUNT must be a whole number")
        rules.append(FaultRule(parts[0], parts[1], int(parts[2]) if len(parts) == 3 else None))
    return rules
