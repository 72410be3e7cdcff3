"""The import rules of docs/ARCHITECTURE.md, checked on the source (no imports run): each fails naming the file,
line and rule it breaks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pagedserve"
# Below the engine: nothing here knows HTTP or the API layer.
BELOW_ENGINE = ("core", "worker", "layers", "models", "memory", "formats", "kernels", "structured", "spec_decode",
                "engine", "distributed")
HTTP_MODULES = ("fastapi", "starlette", "uvicorn", "httpx", "pagedserve.entrypoints")
# Pure Python, so the scheduler and the planners import without torch.
NO_TORCH = ("core", "spec_decode", "config.py", "request.py", "sampling_params.py")
ENV_READ = re.compile(r"os\.getenv\(|os\.environ\.get\(|os\.environ\[|os\.environ\.setdefault\(|environ\.pop\(")


def _files(*parts: str) -> list[Path]:
    files = []
    for part in parts:
        path = PACKAGE / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (lazy imports count too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _breaks(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
            for path in files for line, module in _imports(path)
            if any(module == f or module.startswith(f + ".") for f in forbidden)]


def test_nothing_below_the_engine_knows_http():
    assert _breaks(_files(*BELOW_ENGINE), HTTP_MODULES) == []


def test_layers_do_not_import_models():
    assert _breaks(_files("layers"), ("pagedserve.models",)) == []


def test_memory_does_not_import_models():
    """The memory plan reads checkpoints through formats/, below both: it never pulls in the loader (or torch)."""
    assert _breaks(_files("memory"), ("pagedserve.models",)) == []


def test_formats_are_below_memory_and_models_and_import_no_torch():
    assert _breaks(_files("formats"), ("pagedserve.memory", "pagedserve.models", "torch")) == []


def test_the_scheduler_side_imports_no_torch():
    assert _breaks(_files(*NO_TORCH), ("torch", "numpy")) == []


def test_environment_variables_are_read_only_in_envs_and_cli():
    allowed = {PACKAGE / "envs.py", *(PACKAGE / "cli").rglob("*.py")}
    breaks = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
              for path in PACKAGE.rglob("*.py") if path not in allowed
              for number, line in enumerate(path.read_text().splitlines(), start=1) if ENV_READ.search(line)]
    assert breaks == []


def test_only_the_ray_serve_entrypoint_imports_ray():
    """ray is the optional extra [ray]: pagedserve imports and serves without it."""
    inside = set(_files("entrypoints/ray_serve"))
    assert _breaks([path for path in PACKAGE.rglob("*.py") if path not in inside], ("ray",)) == []


def test_the_rules_can_fail():
    """The checks see real imports: the server itself imports HTTP, and the runner imports torch."""
    assert _breaks(_files("entrypoints"), ("fastapi",))
    assert _breaks(_files("worker"), ("torch",))
    assert _breaks(_files("entrypoints/ray_serve"), ("ray",))
    assert ENV_READ.search('x = os.environ.get("PAGEDSERVE_X")')
