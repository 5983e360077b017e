"""Shared fixtures. The embedded tiny CLIP is pretrained once per test session into a
temporary cache (about 30 s on two cores); every test that needs it shares that cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runconfig import validate  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _flower_task_identity():
    from utils.inprocess import ensure_task_identity

    ensure_task_identity()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A cache directory shared by the session (pretrained tiny CLIP, image features).

    FEDVLM_TEST_CACHE reuses a cache across sessions when developing locally."""
    path = os.environ.get("FEDVLM_TEST_CACHE")
    return Path(path) if path else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def pretrained_clip(cache_dir):
    from models.clip_loader import load_clip

    return load_clip("embedded-tiny", "", cache_dir, "cpu")


@pytest.fixture
def make_cfg(cache_dir, tmp_path):
    def _make(**overrides):
        raw = {"cache-dir": str(cache_dir), "output-dir": str(tmp_path / "runs")}
        raw.update({k.replace("__", ".").replace("_", "-"): v for k, v in overrides.items()})
        return validate(raw)

    return _make


@pytest.fixture(scope="session")
def vlm_cache(cache_dir) -> Path:
    """The cache with the embedded tiny VLM pretrained (about two minutes on two cores, once)."""
    from models.tiny_vlm import ensure_pretrained

    ensure_pretrained(cache_dir)
    return cache_dir
