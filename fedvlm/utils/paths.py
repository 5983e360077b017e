"""Where the project keeps things by default (torch-free: checking a run config imports it)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Pretrained embedded models and image features: $FEDVLM_CACHE, else ~/.cache/fedvlm (the run
    config's cache-dir overrides it)."""
    return Path(os.environ.get("FEDVLM_CACHE") or Path.home() / ".cache" / "fedvlm")


def default_output_dir() -> Path:
    """Run folders, where the run config's output-dir is empty."""
    return Path.home() / "fedvlm-runs"
