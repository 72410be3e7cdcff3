"""`serve --replicas` where ray is not installed (simulated by blocking its import): pagedserve itself imports and
serves without ray, and the Ray mode refuses with the command that fixes it. Runs in every test run."""

from __future__ import annotations

import subprocess
import sys

BLOCK_RAY = "import sys; sys.modules['ray'] = None; "  # `import ray` then raises ImportError, as if not installed


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_RAY + code], capture_output=True, text=True, timeout=120)


def test_pagedserve_imports_without_ray():
    result = run_python("import pagedserve, pagedserve.cli.main, pagedserve.entrypoints.openai.api_server; "
                        "from pagedserve.entrypoints.ray_serve import ray_is_installed; "
                        "assert not ray_is_installed()")
    assert result.returncode == 0, result.stderr


def test_replicas_without_ray_names_the_fix():
    result = run_python("from pagedserve.cli.main import main; sys.exit(main(['serve', 'tiny', '--replicas', '2']))")
    assert result.returncode == 2, result.stderr
    assert "ray is not installed" in result.stderr
    assert "pip install 'pagedserve[ray]'" in result.stderr and "pip install -e '.[ray]'" in result.stderr


def test_replica_flags_are_checked_before_anything_starts():
    result = run_python("from pagedserve.cli.main import main; "
                        "sys.exit(main(['serve', 'tiny', '--replicas', '0']))")
    assert result.returncode == 2 and "--replicas must be >= 1, got 0" in result.stderr, result.stderr
