"""Checkpoint file formats, one reader each, below both `memory/` (the plan reads headers before anything
loads) and `models/` (the loader reads the tensors). No torch: what reads only headers stays cheap to import.
"""

from pathlib import Path

GGUF_MAGIC = b"GGUF"


def is_gguf_path(path: str | Path) -> bool:
    """Whether a model path names a GGUF file: a name ending in .gguf (any case), or a regular file that starts
    with the GGUF magic (Ollama's sha256-... blobs, links without a suffix). The one test every reader uses."""
    path = Path(path)
    if path.name.lower().endswith(".gguf"):
        return not path.is_dir()
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False
