"""--omp-wait-policy reaches OpenMP: it is set in the environment before torch loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.cli.common import thread_environment


def _environment_after(argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """OMP_WAIT_POLICY and GOMP_SPINCOUNT as a fresh process's flags leave them, checked to be set before torch."""
    code = (
        "import argparse, json, os, sys\n"
        "from pagedserve.cli.common import add_thread_args, apply_thread_args, wait_settings\n"
        "parser = argparse.ArgumentParser(); add_thread_args(parser)\n"
        f"apply_thread_args(parser.parse_args({argv!r}))\n"
        "assert 'torch' not in sys.modules\n"
        "print(json.dumps(wait_settings(os.environ)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", **env})
    return json.loads(out.stdout)


@pytest.mark.parametrize("argv,env,expected", [
    ([], {}, {"GOMP_SPINCOUNT": "3000"}),  # the default: a brief spin, then sleep
    (["--omp-wait-policy", "brief"], {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "3000"}),
    (["--omp-wait-policy", "spin"], {}, {"GOMP_SPINCOUNT": "300000"}),  # libgomp's own wait, not ACTIVE's minutes
    (["--omp-wait-policy", "passive"], {"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "PASSIVE"}),  # the flag wins
    ([], {"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),  # no flag: the user's environment stays
    ([], {"GOMP_SPINCOUNT": "100"}, {"GOMP_SPINCOUNT": "100"}),
])
def test_wait_policy_set_before_torch_loads(argv, env, expected):
    assert _environment_after(argv, env) == expected


def test_no_policy_spins_for_minutes():
    """OMP_WAIT_POLICY=ACTIVE (what `spin` set before) kept an idle server's threads spinning: a core busy for
    nothing. Every choice bounds the spin or sleeps."""
    for policy in ("brief", "spin", "passive"):
        env = thread_environment(policy, {})
        assert env.get("OMP_WAIT_POLICY") in (None, "PASSIVE") and int(env.get("GOMP_SPINCOUNT") or 0) <= 300_000
