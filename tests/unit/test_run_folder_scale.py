"""What a round writes grows with the clients it samples, not with the clients that exist: the
ledger's entries name the clients a round charged, its running figures are kept current per
client charged, and results.json's per-node tables are re-encoded only where an entry changed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedvlm.methods.validation import validate
from fedvlm.privacy.budget import RunBudget
from fedvlm.privacy.ledger import PrivacyLedger, final_spent, round_spread, spent_after_rounds
from fedvlm.privacy.planner import ClientShape
from fedvlm.spec import spec_of
from fedvlm.utils import files
from fedvlm.utils.files import PartsKeptJson, json_text


def _budget(clients: int) -> RunBudget:
    cfg = validate({"method": "dpfpl", "privacy.epsilon": 2.0, "privacy.delta": 1e-7, "num-server-rounds": 6})
    shapes = {f"c{i:03d}": ClientShape(40 + i % 7, 32, 1) for i in range(clients)}
    return RunBudget.planned(
        cfg.privacy,
        PrivacyLedger(cfg.privacy, spec_of(cfg).name),
        cfg.num_server_rounds,
        spec_of(cfg).local_dp(cfg),
        spec_of(cfg).global_dp(cfg, 5),
        shapes,
        dict.fromkeys(shapes, "os"),
    )


def test_the_ledger_names_the_clients_a_round_charged_and_keeps_every_figure_current():
    budget = _budget(60)
    planner, rng = budget.planner, np.random.default_rng(0)
    names = sorted(planner.clients)
    for rnd in range(1, 6):
        sampled = sorted(rng.choice(names, size=5, replace=False).tolist())
        more = sorted(rng.choice(names, size=3, replace=False).tolist())
        brute_worst = max(planner.epsilon(n, budget.rounds_trained.get(n, 0) + (n in more)) for n in names)
        assert budget.worst(dict.fromkeys(more, 1)) == pytest.approx(brute_worst, rel=1e-12)
        assert budget.charge_round(sampled) is None
        entry = budget.record_round(rnd, {})
        truth = {n: planner.epsilon(n, budget.rounds_trained.get(n, 0)) for n in names}
        assert sorted(entry["changed"]) == sampled  # only the round's clients, at any number planned
        assert all(entry["changed"][n] == pytest.approx(truth[n], rel=1e-12) for n in sampled)
        assert budget.current()["spent"] == pytest.approx(truth, rel=1e-12)
        values = list(truth.values())
        assert round_spread(entry) == pytest.approx((min(values), float(np.mean(values)), max(values)), rel=1e-12)
        for mech, per in entry["components"].items():
            assert isinstance(per, float) or sorted(per) == sampled, mech
    section = budget.ledger_section()
    carried = {r: dict(s) for r, s in spent_after_rounds(section)}
    assert final_spent(section) == section["spent"]
    assert {n: carried[5].get(n, 0.0) for n in names} == pytest.approx(section["spent"], rel=1e-12)


def test_a_resumed_budget_states_what_was_spent_and_enters_only_what_changes():
    whole = _budget(20)
    for rnd, sampled in enumerate((["c001", "c002"], ["c002", "c003"]), start=1):
        whole.charge_round(sampled)
        whole.record_round(rnd, {})
    resumed = _budget(20)
    resumed.load_state_dict(json.loads(json.dumps(whole.state_dict())))
    assert resumed.current() == whole.current()  # the same accountant calls on the same counts
    resumed.charge_round(["c004"])
    assert list(resumed.record_round(3, {})["changed"]) == ["c004"]


def test_an_earlier_fedvlm_ledger_reads_the_same():
    """Run folders written before entries named only the clients charged list every client."""
    legacy = {"rounds": [{"round": 1, "epsilon": 0.5, "per_client": {"a": 0.5, "b": 0.0}}]}
    legacy["rounds"].append({"round": 2, "epsilon": 0.7, "per_client": {"a": 0.5, "b": 0.7}})
    assert final_spent(legacy) == {"a": 0.5, "b": 0.7}
    assert round_spread(legacy["rounds"][1]) == pytest.approx((0.5, 0.6, 0.7))


def test_kept_parts_encode_as_the_whole_and_only_replaced_entries_again(monkeypatch):
    nodes = [{"name": f"n{i}", "x": i} for i in range(200)]
    data = {"run": {"nodes": nodes, "status": "running"}, "privacy": {"spent": {"a": 0.1}}, "rounds": []}
    kept = PartsKeptJson((("run", "nodes"), ("privacy", "spent"), ("privacy", "absent"), ("nowhere", "x")))
    assert json.loads(kept.encode(data)) == data
    encoded: list = []
    real = files.json_text
    monkeypatch.setattr(files, "json_text", lambda obj: encoded.append(obj) or real(obj))
    data["run"]["nodes"] = [*nodes[:5], {"name": "n5", "x": -1}, *nodes[6:], {"name": "new", "x": 0}]
    data["privacy"]["spent"] = {"a": 0.1, "b": math.nan}
    text = kept.encode(data)
    assert json.loads(text) == json.loads(real(data))  # NaN as null, like the whole
    entries = [e for e in encoded if isinstance(e, dict) and "name" in e]
    assert entries == [{"name": "n5", "x": -1}, {"name": "new", "x": 0}]  # the others' text was kept
    del data["run"]["nodes"][0]
    assert json.loads(kept.encode(data)) == json.loads(real(data))


def test_data_that_holds_the_token_is_encoded_whole():
    data = {"run": {"nodes": [PartsKeptJson.TOKEN.format(0)], "note": PartsKeptJson.TOKEN.format(0)}}
    assert json.loads(PartsKeptJson((("run", "nodes"),)).encode(data)) == data
    assert json_text(data) == PartsKeptJson((("run", "nodes"),)).encode(data)
