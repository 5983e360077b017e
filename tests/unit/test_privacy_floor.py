"""A node's own privacy floor (client_app.privacy_floor): it recomputes what the server's plan
would spend on its records and refuses past its limit, whatever the run config says."""

from __future__ import annotations

import pytest
from flwr.app import RecordDict

from fedvlm.client_app.privacy_floor import NodeFloor, Release, check_round, guard, load_ledger, record
from fedvlm.methods.validation import validate
from fedvlm.privacy.planner import ClientShape, NoiseRefused, local_plan
from fedvlm.protocol import TrainInstruction
from fedvlm.runconfig import ConfigError

N_TRAIN, BATCH, ROUNDS = 200, 32, 10


def _plan(**overrides):
    """A run config and the train instruction its server would send (the sigma it plans)."""
    cfg = validate({"method": "promptfl", "num-server-rounds": ROUNDS, "prompt.batch-size": BATCH, **overrides})
    shape = ClientShape(N_TRAIN, BATCH, 1)
    sigma = local_plan(cfg.privacy, cfg.spec.local_dp(cfg), shape, ROUNDS).sigma if cfg.privacy.enabled else None
    return cfg, TrainInstruction(1, ("ctx",), 1, BATCH, N_TRAIN, sigma)


def test_the_node_config_states_both_numbers():
    assert NodeFloor.from_node_config({}) is None
    assert NodeFloor.from_node_config({"max-epsilon": 3.0, "delta": 1e-5}) == NodeFloor(3.0, 1e-5)
    for bad in (
        {"max-epsilon": 3.0},
        {"delta": 1e-5},
        {"max-epsilon": -1, "delta": 1e-5},
        {"max-epsilon": 1, "delta": 2},
    ):
        with pytest.raises(ConfigError, match="max-epsilon"):
            NodeFloor.from_node_config(bad)


def test_the_node_recomputes_the_servers_plan_with_the_same_accountant():
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    # the run's own delta: the node's figure is the plan's epsilon
    row = check_round(NodeFloor(2.5, cfg.privacy.delta), cfg, instruction, [], noise_source="os")
    assert 0 < row["epsilon"] < 2.0 and row["steps"] == 1 and row["sampling-rate"] == pytest.approx(BATCH / N_TRAIN)
    with pytest.raises(
        NoiseRefused, match=r"plan would spend epsilon = 2(\.0+)? per record over 10 rounds.*limit max-epsilon = 1\.5"
    ):
        check_round(NodeFloor(1.5, cfg.privacy.delta), cfg, instruction, [], noise_source="os")


def test_a_server_that_weakens_the_config_is_refused():
    cfg, instruction = _plan(**{"privacy.epsilon": 50.0})  # the server's config and sigma agree
    with pytest.raises(NoiseRefused, match=r"epsilon = 50 per record over 10 rounds \(sigma 0\.09"):
        check_round(NodeFloor(3.0, 1e-5), cfg, instruction, [], noise_source="os")


def test_the_running_ledger_stops_what_the_plan_did_not_announce():
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    floor = NodeFloor(2.05, cfg.privacy.delta)
    state = RecordDict()
    rows = []
    for r in range(1, ROUNDS + 1):  # the planned rounds fit
        row = check_round(floor, cfg, _at(instruction, r), load_ledger(state), "os")
        rows.append(record(state, Release(row, limited=True), fresh=True))
    assert rows == sorted(rows) and rows[-1] == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(NoiseRefused, match=f"after {ROUNDS + 1} rounds"):  # one more than announced
        check_round(floor, cfg, _at(instruction, ROUNDS + 1), load_ledger(state), "os")


def test_a_round_trained_again_counts_twice():
    """OS noise: a rerun of the same round (after a resume) is a second, independent release."""
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    floor = NodeFloor(5.0, cfg.privacy.delta)
    state = RecordDict()
    first = record(state, Release(check_round(floor, cfg, instruction, load_ledger(state), "os"), True), fresh=True)
    again = record(state, Release(check_round(floor, cfg, instruction, load_ledger(state), "os"), True), fresh=True)
    assert len(load_ledger(state)) == 2 and again > first


def test_every_private_node_keeps_the_one_ledger_and_a_seeded_rerun_counts_once():
    """Without a limit too (a reprogramming node's Opacus figures are read from it). A round
    trained again with seeded noise releases the same tensor: its row gives way to the new one;
    with OS noise it is a second release and counts twice."""
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    state = RecordDict()
    release = guard({}, state, cfg, instruction, "seeded")
    assert release is not None and not release.limited
    first = record(state, release, fresh=False)
    again = record(state, guard({}, state, cfg, instruction, "seeded"), fresh=False)
    assert len(load_ledger(state)) == 1 and again == pytest.approx(first)
    later = record(state, guard({}, state, cfg, _at(instruction, 2), "seeded"), fresh=False)
    assert [r["round"] for r in load_ledger(state)] == [1, 2] and later > first
    os_state = RecordDict()
    record(os_state, guard({}, os_state, cfg, instruction, "os"), fresh=True)
    twice = record(os_state, guard({}, os_state, cfg, instruction, "os"), fresh=True)
    assert len(load_ledger(os_state)) == 2 and twice == pytest.approx(later)
    off, sent = _plan()  # no privacy: no local noise, nothing the ledger could account
    assert guard({}, RecordDict(), off, sent, "seeded") is None


def test_a_limit_on_regenerable_noise_is_refused():
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    with pytest.raises(NoiseRefused, match="draws seeded noise.*regenerate it.*protect nothing"):
        check_round(NodeFloor(5.0, cfg.privacy.delta), cfg, instruction, [], "seeded")


def test_methods_and_runs_that_give_no_bound_against_the_server_are_refused():
    cfg, instruction = _plan()
    with pytest.raises(NoiseRefused, match="without privacy"):
        check_round(NodeFloor(3.0, 1e-5), cfg, instruction, [], noise_source="os")
    dpfpl = validate({"method": "dpfpl", "privacy.epsilon": 2.0})
    with pytest.raises(NoiseRefused, match="un-noised updates"):
        check_round(NodeFloor(3.0, 1e-5), dpfpl, instruction, [], noise_source="os")


def _at(instruction: TrainInstruction, r: int) -> TrainInstruction:
    from dataclasses import replace

    return replace(instruction, server_round=r)
