"""The test-only fault-injection hook, and the scheduler failing one request while the others go on (no torch)."""

from __future__ import annotations

import pytest

from pagedserve.engine.faults import FaultInjector, parse_fault_spec
from pagedserve.exceptions import InjectedFault
from tests.unit.test_scheduler import assert_no_leaks, fake_runner, make_request, make_scheduler


def test_spec_parses_and_counts():
    faults = FaultInjector("add:poison,step:*:1")
    faults.check("add", "cmpl-fine")  # no match: nothing happens
    with pytest.raises(InjectedFault):
        faults.check("add", "cmpl-poison-1")
    with pytest.raises(InjectedFault):
        faults.check("step", "a", "b")
    faults.check("step", "a", "b")  # its one time is used up
    assert FaultInjector(None).rules == []


@pytest.mark.parametrize("spec", ["nowhere:x", "add", "add:", "step:*:many"])
def test_bad_spec_is_refused(spec):
    with pytest.raises(ValueError, match="--fault-injection"):
        parse_fault_spec(spec)


@pytest.mark.parametrize("stage", ["schedule", "postprocess"])
def test_a_fault_in_one_request_fails_only_that_request(stage):
    sched = make_scheduler()
    faults = FaultInjector(f"{stage}:poison")
    sched.fault_hook = faults.check
    for rid in ("a", "poison", "b"):
        sched.add_request(make_request(rid, range(6), max_tokens=3))
    results: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        failed.update(sched.take_failed())
        for o in sched.update_from_output(out, fake_runner(out)):
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
        failed.update(sched.take_failed())
    assert list(failed) == ["poison"] and "InjectedFault" in failed["poison"]
    assert results["a"] == results["b"] == [7, 7, 7]
    assert "poison" not in results
    assert_no_leaks(sched)
