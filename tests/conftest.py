"""Shared fixtures. The embedded tiny CLIP is pretrained once per test session into a
temporary cache (about 30 s on two cores); every test that needs it shares that cache.

Tests live by kind: ``unit/`` (one module, real components, seconds), ``integration/``
(in-process federations through the real strategies and ClientApp), ``e2e/`` (``flwr run``
and SuperLink/SuperNode processes). Each test is marked with its directory's name, so
``pytest -m unit`` runs the fast ones; tests that take more than about 20 s are also marked
``slow``, as is every e2e test. The default selection (pyproject's addopts) skips slow tests
except those marked ``ci``; ``pytest -m slow`` runs the others.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fedvlm.methods.validation import validate  # noqa: E402

KINDS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in KINDS:
            item.add_marker(kind)
        if kind == "e2e":  # processes, Ray, a SuperLink: never quick
            item.add_marker("slow")


@pytest.fixture(autouse=True, scope="session")
def _flower_task_identity():
    from fedvlm.utils.inprocess import ensure_task_identity

    ensure_task_identity()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A cache directory shared by the session (pretrained tiny CLIP, image features).

    FEDVLM_TEST_CACHE reuses a cache across sessions when developing locally."""
    path = os.environ.get("FEDVLM_TEST_CACHE")
    return Path(path) if path else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def pretrained_clip(cache_dir):
    from fedvlm.models.clip_loader import load_clip

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
    from fedvlm.models.tiny_vlm import ensure_pretrained

    ensure_pretrained(cache_dir)
    return cache_dir


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory, cache_dir, pretrained_clip):
    """Environment for `flwr run` with its own FLWR_HOME and a local simulation SuperLink on
    free ports; the SuperLink and its children are stopped by PID at the end of the module."""
    from fedvlm.utils.processes import flwr_env as make_env
    from fedvlm.utils.processes import kill_tree, pids_matching

    # One local SuperLink for the module (each run still starts its own Ray simulation).
    home = tmp_path_factory.mktemp("flwr") / "flwr-home"
    env = make_env(home)
    yield env
    for pid in pids_matching(str(home)):  # the detached local SuperLink and its children
        kill_tree(pid)
    assert not pids_matching(str(home)), "a Flower process survived the test"


def pytest_report_header(config):
    """The CPU kernel family in every log, so a regression fixture can be recorded for CI's."""
    from regression import kernels

    return f"regression kernels: {kernels()}"
