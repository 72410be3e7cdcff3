from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir('llama') -> path of a saved tiny random model (cached per session)."""
    from tests.tiny_models import make_tiny_model

    cache: dict[tuple, str] = {}

    def get(arch: str, dtype: str = "float32", **overrides) -> str:
        key = (arch, dtype, repr(sorted(overrides.items())))  # repr: values may be dicts (rope_scaling)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{dtype}")
            cache[key] = str(make_tiny_model(arch, out, dtype, **overrides))
        return cache[key]

    return get
