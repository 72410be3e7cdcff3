"""Helpers for the browser tests: Chromium's path and flags, the console-error record, screenshots, metrics."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).parent / "artifacts"
# Without the background-networking flags Chromium keeps trying to reach Google on a closed network.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The engine on one passive thread: Chromium needs the other core, and spinning OpenMP threads that share
# a core with it slow decoding ~30x (README, CPU threads).
SERVER_FLAGS = ("--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "4096",
                "--num-threads", "1", "--omp-wait-policy", "passive")
FAILED_RESOURCE = re.compile(r"Failed to load resource: the server responded with a status of (\d+)")


def chromium_path() -> str:
    path = os.environ.get("PAGEDSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("the browser tests need Debian's chromium: `apt-get install -y chromium` (the README's test "
                    "command installs it), or PAGEDSERVE_CHROMIUM=/path/to/chromium", pytrace=False)
    return path


@dataclass
class PageErrors:
    """Console errors and page errors seen by one page, minus failed responses the test expects."""

    allowed_statuses: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    def on_console(self, message) -> None:
        if message.type != "error":
            return
        failed = FAILED_RESOURCE.search(message.text)
        if failed and int(failed.group(1)) in self.allowed_statuses:
            return
        self.errors.append(f"console: {message.text} ({message.location.get('url', '')})")

    def on_page_error(self, error) -> None:
        self.errors.append(f"page error: {error}")


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def metric(server, name: str) -> float:
    """A sample of the server's /metrics, summed over its labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    if not values:
        raise KeyError(name)
    return sum(values)


def browser_model(tiny_model_dir) -> str:
    """The tiny model, trained (as its config says) for the 4096 positions of SERVER_FLAGS' --max-model-len:
    a longer context than a model was trained for is refused."""
    return tiny_model_dir("llama", max_position_embeddings=4096)
