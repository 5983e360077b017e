"""The one-run privacy audit end to end, in-process: the real strategies and ClientApp, canaries
on the audited node, the audit section of results.json beside the ledger.

The broken-mechanism test is the audit's reason to exist: with the DP noise switched off while
the ledger still claims epsilon 1, the canaries prove a larger epsilon; with the real noise, the
same audit stays at or below what the ledger accounts."""

from __future__ import annotations

from pathlib import Path

import pytest
from regression import CASES

import fedvlm.privacy.dpsgd as dpsgd
from fedvlm import status
from fedvlm.client_app import node_round
from fedvlm.client_app.app import app as client_app
from fedvlm.client_app.state import AUDIT
from fedvlm.methods.validation import validate
from fedvlm.metrics import STEPS
from fedvlm.privacy.audit import AuditRefused
from fedvlm.runconfig import ConfigError
from fedvlm.server_app.app import execute
from fedvlm.spec import spec_of
from fedvlm.utils.inprocess import InProcessGrid

# few records per node (4 per class) and 25 local steps: each canary is sampled several times
SMALL = {
    "method": "promptfl",
    "privacy__epsilon": 1.0,
    "max_per_class": 4,
    "num_server_rounds": 5,
    "prompt__local_steps": 5,
    "fraction_evaluate": 0.34,
}


def _run(make_cfg, n=3, **overrides):
    cfg = make_cfg(**{**SMALL, **overrides})
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], cfg.as_dict())
    return execute(cfg, grid, run_id="audit").data, grid


def _no_noise(grads, step, noise):
    return {k: v.detach() for k, v in grads.items()}


@pytest.mark.slow
@pytest.mark.ci  # the one end-to-end audit kept in CI: it must catch a broken mechanism
def test_the_audit_catches_noise_switched_off_and_passes_the_real_mechanism(make_cfg, pretrained_clip, monkeypatch):
    honest, grid = _run(make_cfg, privacy__audit_canaries=100)
    node = honest["audit"]["nodes"]["client-0"]
    assert node["canaries"] == 100 and node["private_steps"] == 25
    assert node["accounted_epsilon"] == pytest.approx(1.0, abs=1e-3)  # the ledger's figure for the node
    assert node["epsilon_lower"] <= node["accounted_epsilon"]
    assert node["status"].startswith("consistent")

    # only the audited node carries canaries: its record count includes their 100 slots
    nodes = {n["name"]: n for n in honest["run"]["nodes"]}
    real = {name: grid_node["num_train"] for name, grid_node in nodes.items()}
    assert [AUDIT in ctx.state for ctx in grid.contexts.values()] == [True, False, False]

    monkeypatch.setattr(dpsgd, "_add_noise", _no_noise)  # the bug: the noise never reaches the step
    broken, _ = _run(make_cfg, privacy__audit_canaries=100)
    node = broken["audit"]["nodes"]["client-0"]
    assert broken["privacy"]["spent"]["client-0"] == pytest.approx(1.0, abs=1e-3)  # still claimed
    assert node["epsilon_lower"] > 1.5 * node["accounted_epsilon"]
    assert node["status"].startswith("BROKEN")

    plain, _ = _run(make_cfg)
    assert "audit" not in plain
    plain_nodes = {n["name"]: n["num_train"] for n in plain["run"]["nodes"]}
    assert real["client-0"] == plain_nodes["client-0"] + 100
    assert {k: v for k, v in real.items() if k != "client-0"} == {
        k: v for k, v in plain_nodes.items() if k != "client-0"
    }


def test_per_batch_clipping_fails_its_stated_epsilon_and_the_ledger_says_so(make_cfg, pretrained_clip):
    data, _ = _run(make_cfg, privacy__audit_canaries=100, privacy__clipping="per-batch")
    node = data["audit"]["nodes"]["client-0"]
    assert node["epsilon_lower"] > 1.0  # the stated privacy.epsilon does not hold ...
    assert node["epsilon_lower"] <= node["accounted_epsilon"]  # ... the ledger's true-sensitivity figure does


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"privacy__epsilon": 0.0}, "privacy is off"),
        ({"method": "pfedmoap", "pfedmoap__dp_placement": "upload"}, "no per-record step"),
    ],
)
def test_an_audit_without_a_per_record_mechanism_is_refused(make_cfg, overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_cfg(**{**SMALL, "privacy__audit_canaries": 10, **overrides})


# every method with a per-record DP mechanism, on the regression cases' small configs
DP_CASES = ["promptfl-dp", "dpfpl-dp", "fedotp-dp", "fedpgp-dp", "pfedmoap-dp", "reprogram", "bl-pf", "bl-ff", "bl-ts"]
VLM_DP_CASES = ["fedrand-dp", "fedavg-lora", "fedper-lora", "fedpara-lora"]


def _audited_case(name: str, cache, tmp_path) -> tuple[dict, object]:
    base, n = CASES[name]
    raw = {"cache-dir": str(cache), "output-dir": str(tmp_path), **base, "privacy.audit-canaries": 20}
    if "privacy.epsilon" not in raw and "reprogram" not in raw.get("method", "") and not name.startswith("bl-"):
        raw["privacy.epsilon"] = 4.0
    cfg = validate(raw)
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], cfg.as_dict())
    return execute(cfg, grid, run_id="audit").data, cfg


def _check_audited(data: dict, cfg) -> None:
    section = data["audit"]
    assert section["mechanism"] == spec_of(cfg).local_dp(cfg).name
    node = section["nodes"]["client-0"]
    steps = [r["clients"].get("client-0", {}).get(f"train/{STEPS}") for r in data["rounds"]]
    assert any(steps) and node["private_steps"] == sum(s for s in steps if s)  # every private step scored
    assert node["canaries"] == 20 and 0 <= node["correct"] <= node["guesses"] <= 20
    assert node["status"].startswith("consistent")


# over about 20 s each on two cores: out of the default selection (pytest -m slow runs them)
SLOW_AUDITS = ("promptfl-dp", "dpfpl-dp", "fedotp-dp", "reprogram")  # out of CI for its time; `-m slow`


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_AUDITS else n for n in DP_CASES])
def test_every_prompt_and_reprogramming_method_can_be_audited(name, cache_dir, pretrained_clip, tmp_path):
    _check_audited(*_audited_case(name, cache_dir, tmp_path))


@pytest.mark.parametrize("name", VLM_DP_CASES)
def test_every_lora_method_can_be_audited(name, vlm_cache, tmp_path):
    _check_audited(*_audited_case(name, vlm_cache, tmp_path))


def test_an_audit_its_node_cannot_hold_ends_the_run_at_its_first_round(make_cfg, pretrained_clip):
    """More canaries than the noised context has coordinates: the audited node refuses each round
    (its reason names the fix); the run ends at round 1 with that reason instead of training on
    without the audit, and ``fedvlm.status`` says why."""
    cfg = make_cfg(**{**SMALL, "privacy__audit_canaries": 5000})
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": 3} for i in range(3)], cfg.as_dict())
    with pytest.raises(AuditRefused, match=r"privacy.audit-canaries <= \d+"):
        execute(cfg, grid, run_id="audit")
    run_dir = next(Path(cfg.output_dir).glob("*/results.json")).parent
    found = status.check(run_dir)
    assert found.code == status.FAILED and "AuditRefused" in found.reason and "client-0" in found.reason
    assert "1 of 5 rounds" in found.reason


def test_an_audit_never_reported_is_missing_and_fails_the_status(make_cfg, pretrained_clip, monkeypatch):
    """The audited node's every train reply fails for another reason than its canaries: the run
    trains on without it, its audit section says the audit asked for is missing and why, and
    ``fedvlm.status`` fails it (exit 6); a run whose audit came passes."""

    def fails(*args):
        raise RuntimeError("the audited node's disk is full")

    monkeypatch.setattr(node_round, "finish_round", fails)
    data, _ = _run(make_cfg, privacy__audit_canaries=20, num_server_rounds=2)
    assert data["audit"]["status"].startswith("MISSING") and "node client-0" in data["audit"]["status"]
    assert [r.get("dropped", [{}])[0].get("client") for r in data["rounds"]] == ["client-0", "client-0"]
    found = status.verdict(data, status.MAX_LOST, 0.0)
    assert found.code == status.AUDIT and "MISSING" in found.reason
    monkeypatch.undo()
    data, _ = _run(make_cfg, privacy__audit_canaries=20, num_server_rounds=2)
    assert status.verdict(data, status.MAX_LOST, 0.0).code == status.OK
