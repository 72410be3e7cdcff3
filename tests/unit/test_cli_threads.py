"""--omp-wait-policy reaches OpenMP: it is set in the environment before torch loads."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("flag,expected", [("passive", "PASSIVE"), ("spin", "ACTIVE")])
def test_wait_policy_set_before_torch_loads(flag, expected):
    code = (
        "import argparse, os, sys\n"
        "from pagedserve.cli.common import add_thread_args, apply_thread_args\n"
        "parser = argparse.ArgumentParser(); add_thread_args(parser)\n"
        f"apply_thread_args(parser.parse_args(['--omp-wait-policy', '{flag}']))\n"
        "assert 'torch' not in sys.modules\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == expected
