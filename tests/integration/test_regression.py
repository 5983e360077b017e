"""Every method's per-round metrics on the embedded default equal the recorded fixture
(``tests/regression.py`` says how to record it), so that a change which should not move a
number is shown not to."""

from __future__ import annotations

import json

import pytest
from regression import CASES, FIXTURE, KERNELS_KEY, differences, explain, kernels, recorded, run_case

from fedvlm.methods.registry import get_method

FIXED = json.loads(FIXTURE.read_text())
VLM_CASES = [c for c, (raw, _) in CASES.items() if get_method(raw["method"]).family.image_text]


def _check(name: str, cache, tmp_path) -> None:
    mine = recorded(FIXED)
    if mine is None:
        pytest.skip(
            f"the fixture holds records for {sorted(FIXED.get(KERNELS_KEY, {}))} CPU kernels, this machine runs "
            f"{kernels()}: seeded numbers differ across kernel families; record this one with "
            "python tests/regression.py --write"
        )
    assert name in mine, f"no fixture for {name}: python tests/regression.py --write --cases {name}"
    got = run_case(name, cache, tmp_path)
    assert not differences(mine[name], got), explain(differences(mine[name], got), FIXED)


@pytest.mark.parametrize("name", [c for c in CASES if c not in VLM_CASES])
def test_metrics_equal_the_fixture(name, cache_dir, pretrained_clip, tmp_path):
    _check(name, cache_dir, tmp_path)


@pytest.mark.parametrize("name", VLM_CASES)
def test_lora_metrics_equal_the_fixture(name, vlm_cache, tmp_path):
    _check(name, vlm_cache, tmp_path)


def test_a_mismatch_names_the_packages_that_changed(monkeypatch):
    import regression

    recorded = {**regression.versions(), "torch": "0.0.1"}
    assert regression.changed_versions(recorded) == [f"torch 0.0.1 -> {regression.versions()['torch']}"]
    assert "torch 0.0.1 ->" in explain(["round 1: local-acc = 0.5, fixture 0.4"], {"_versions": recorded})
    mine = {"_versions": regression.versions(), KERNELS_KEY: {kernels(): {}}}
    assert "CPU kernels are the fixture's: the code changed a number" in explain(["x"], mine)
    legacy = {"_versions": regression.versions(), KERNELS_KEY: {kernels().split("/")[0]: {}}}
    assert "need their own record" in explain(["x"], legacy)


def test_the_fixture_holds_a_record_for_the_ci_machines_kernels():
    """CI runs on AVX-512 machines of two vendors so far: a fixture without their records would
    skip every case there."""
    levels = {key.split("/")[0] for key in FIXED[KERNELS_KEY]}
    assert levels == {"AVX512"}
    assert len(FIXED[KERNELS_KEY]) >= 2


def test_the_kernel_key_names_level_vendor_and_digest_and_prefers_the_full_key():
    import regression

    level, vendor, digest = kernels().split("/")
    assert level and vendor and len(digest) == 12
    assert kernels() == kernels()
    full, bare = {"case": [{"x": 1.0}]}, {"case": [{"x": 2.0}]}
    assert recorded({KERNELS_KEY: {kernels(): full, level: bare}}) is full
    assert recorded({KERNELS_KEY: {level: bare}}) is bare
    assert recorded({KERNELS_KEY: {f"{level}/other/000000000000": full}}) is None
    assert regression.recorded({}) is None


def test_a_figure_added_since_the_record_moves_no_recorded_number():
    from regression import differences

    record = [{"acc": 0.5}, {"acc": 0.6}]
    assert differences(record, [{"acc": 0.5, "acc-worst": 0.1}, {"acc": 0.6, "acc-worst": 0.2}]) == []
    assert differences(record, [{"acc": 0.5}, {"acc": 0.7}]) == ["round 2: acc = 0.7, fixture 0.6"]
    assert differences(record, [{"acc": 0.5}, {}]) == ["round 2: acc only in the fixture"]
    mixed = [{"acc": 0.5}, {"acc": 0.6, "late": 1.0}]  # a figure the record has in some rounds is pinned
    assert differences(mixed, [{"acc": 0.5, "late": 1.0}, {"acc": 0.6, "late": 1.0}]) == [
        "round 1: late only in this run"
    ]
