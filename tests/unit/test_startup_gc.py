"""`serve` pauses the garbage collector for start-up and resumes it when start-up ends, either way.

Each case runs in a fresh interpreter: gc.freeze() would otherwise keep the test process's objects."""

import subprocess
import sys

import pytest

CASE = """
import gc
from pagedserve.engine.startup import StartupTracker, pause_garbage_collection
frozen_before = gc.get_freeze_count()  # 0, unless the interpreter's set-up or an import froze objects
{pause}
tracker = StartupTracker()
assert gc.isenabled() is {enabled_while_starting}, "collection while starting"
tracker.enter("resolving")
assert gc.isenabled() is {enabled_while_starting}, "collection while resolving"
{end}
assert gc.isenabled(), "collection after start-up"
print(gc.get_freeze_count() - frozen_before)
"""


def _frozen_after(pause: bool, end: str) -> int:
    code = CASE.format(pause="pause_garbage_collection()" if pause else "", enabled_while_starting=not pause,
                       end=end)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.parametrize("end", ['tracker.enter("ready")', 'tracker.fail("no model")'])
def test_a_paused_start_up_resumes_collection_and_freezes_what_it_built(end):
    assert _frozen_after(pause=True, end=end) > 1000


def test_a_start_up_that_did_not_pause_freezes_nothing():
    # Engines built in-process (tests, LLM) must not have their objects frozen out of collection.
    assert _frozen_after(pause=False, end='tracker.enter("ready")') == 0
