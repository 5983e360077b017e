"""A node's own privacy floor (client_app.privacy_floor): it recomputes what the server's plan
would spend on its records and refuses past its limit, whatever the run config says, across
every run that touched its data (the ledger on its own disk)."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
from flwr.app import RecordDict

from fedvlm.client_app.node import NodeData
from fedvlm.client_app.privacy_floor import (
    NodeFloor,
    guard,
    hello_check,
    ledger,
    record,
    run_history,
)
from fedvlm.methods.validation import validate
from fedvlm.privacy.planner import ClientShape, NoiseRefused, client_plan, local_plan
from fedvlm.protocol import TrainInstruction
from fedvlm.runconfig import ConfigError
from fedvlm.spec import spec_of

N_TRAIN, BATCH, ROUNDS = 200, 32, 10


def _plan(rounds=ROUNDS, **overrides):
    """A run config and the train instruction its server would send (the sigma it plans)."""
    cfg = validate({"method": "promptfl", "num-server-rounds": rounds, "prompt.batch-size": BATCH, **overrides})
    shape = ClientShape(N_TRAIN, BATCH, 1)
    sigma = local_plan(cfg.privacy, spec_of(cfg).local_dp(cfg), shape, rounds).sigma if cfg.privacy.enabled else None
    return cfg, TrainInstruction(1, ("ctx",), 1, BATCH, N_TRAIN, sigma, run_dir="/runs/a")


def _node(config: dict, noise_source: str = "os", name: str = "org-a", partition_id: int = 0) -> NodeData:
    return NodeData(name, partition_id, None, None, config, noise_source)  # type: ignore[arg-type]  # the floor reads no data


def _limited(tmp_path, eps: float, delta: float = 1e-5, **extra) -> NodeData:
    return _node({"max-epsilon": eps, "delta": delta, "state-dir": str(tmp_path / "state"), **extra})


def _at(instruction: TrainInstruction, r: int, run: str | None = None) -> TrainInstruction:
    return replace(instruction, server_round=r, run_dir=instruction.run_dir if run is None else run)


def _train(node, state, cfg, instruction) -> float:
    release = guard(node, state, cfg, instruction)
    assert release is not None
    return record(node, state, cfg, release)


def test_the_node_config_states_both_numbers_and_where_the_ledger_lives(tmp_path):
    state = {"state-dir": str(tmp_path)}
    assert NodeFloor.from_node_config({}) is None
    assert NodeFloor.from_node_config({"max-epsilon": 3.0, "delta": 1e-5, **state}) == NodeFloor(3.0, 1e-5)
    for bad in (
        {"max-epsilon": 3.0, **state},
        {"delta": 1e-5},
        {"max-epsilon": -1, "delta": 1e-5, **state},
        {"max-epsilon": 1, "delta": 2, **state},
        {"max-epsilon": float("inf"), "delta": 1e-5, **state},  # a limit that limits nothing
        {"max-epsilon": "inf", "delta": 1e-5, **state},
        {"max-epsilon": float("nan"), "delta": 1e-5, **state},
    ):
        with pytest.raises(ConfigError, match="finite max-epsilon > 0|delta but not max-epsilon"):
            NodeFloor.from_node_config(bad)
    with pytest.raises(ConfigError, match="max-epsilon needs state-dir.*spans every run"):
        NodeFloor.from_node_config({"max-epsilon": 3.0, "delta": 1e-5})


def test_the_node_recomputes_the_servers_plan_with_the_same_accountant(tmp_path):
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    # the run's own delta: the node's figure is the plan's epsilon
    release = guard(_limited(tmp_path, 2.5, cfg.privacy.delta), RecordDict(), cfg, instruction)
    assert release is not None and release.limited
    assert release.row["steps"] == 1 and release.row["sampling-rate"] == pytest.approx(BATCH / N_TRAIN)
    with pytest.raises(
        NoiseRefused, match=r"plan would spend epsilon = 2(\.0+)? per record over 10 rounds.*limit max-epsilon = 1\.5"
    ):
        guard(_limited(tmp_path, 1.5, cfg.privacy.delta), RecordDict(), cfg, instruction)


def test_a_server_that_weakens_the_config_is_refused(tmp_path):
    cfg, instruction = _plan(**{"privacy.epsilon": 50.0})  # the server's config and sigma agree
    node = _limited(tmp_path, 3.0)
    with pytest.raises(NoiseRefused, match=r"epsilon = 50 per record over 10 rounds \(sigma 0\.09"):
        guard(node, RecordDict(), cfg, instruction)
    with pytest.raises(NoiseRefused, match=r"spent epsilon = 0 of this node's limit.*would bring them to 50"):
        hello_check(node, RecordDict(), cfg, N_TRAIN)  # and at the handshake, before any round


def test_the_running_ledger_stops_what_the_plan_did_not_announce(tmp_path):
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    node, state = _limited(tmp_path, 2.05, cfg.privacy.delta), RecordDict()
    spent = [_train(node, state, cfg, _at(instruction, r)) for r in range(1, ROUNDS + 1)]  # the planned rounds fit
    assert spent == sorted(spent) and spent[-1] == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(NoiseRefused, match=f"after {ROUNDS + 1} releases"):  # one more than announced
        guard(node, state, cfg, _at(instruction, ROUNDS + 1))


def test_a_round_trained_again_counts_twice(tmp_path):
    """OS noise: a rerun of the same round (after a resume) is a second, independent release."""
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    node, state = _limited(tmp_path, 5.0, cfg.privacy.delta), RecordDict()
    first = _train(node, state, cfg, instruction)
    again = _train(node, state, cfg, instruction)
    assert len(ledger(node, state).rows()) == 2 and again > first


@pytest.mark.parametrize("on_disk", [False, True])
def test_every_private_node_keeps_the_one_ledger_and_a_seeded_rerun_counts_once(on_disk, tmp_path):
    """Without a limit, with a state-dir (on its disk, across runs) or without (the run's, in its
    state; a reprogramming node's Opacus figures are read from it). A round trained again with
    seeded noise (a resumed simulation) releases the same tensor: its row gives way to the new
    one; with OS noise it is a second release and counts twice."""
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    where = {"state-dir": str(tmp_path / "state")} if on_disk else {}
    seeded, state = _node(where, "seeded", name="seeded"), RecordDict()
    release = guard(seeded, state, cfg, instruction)
    assert release is not None and not release.limited
    first = record(seeded, state, cfg, release)
    again = _train(seeded, state, cfg, instruction)
    assert len(ledger(seeded, state).rows()) == 1 and again == pytest.approx(first)
    later = _train(seeded, state, cfg, _at(instruction, 2))
    assert [r["round"] for r in ledger(seeded, state).rows()] == [1, 2] and later > first
    fresh, os_state = _node(where, "os", name="fresh"), RecordDict()
    _train(fresh, os_state, cfg, instruction)
    twice = _train(fresh, os_state, cfg, instruction)
    assert len(ledger(fresh, os_state).rows()) == 2 and twice == pytest.approx(later)
    assert [r["round"] for r in run_history(fresh, os_state, "/runs/a", 2)] == [1, 1]
    off, sent = _plan()  # no privacy: no local noise, nothing the ledger could account
    assert guard(_node({}, "seeded"), RecordDict(), off, sent) is None
    if on_disk:  # nothing of it in the runs' states: the node's ledgers are files of their own
        assert not list(state.keys()) and len(list((tmp_path / "state" / "ledgers").glob("*.json"))) == 2


def test_a_limit_on_regenerable_noise_is_refused(tmp_path):
    cfg, instruction = _plan(**{"privacy.epsilon": 2.0})
    node = _node({"max-epsilon": 5.0, "delta": 1e-5, "state-dir": str(tmp_path)}, "seeded")
    for check in (lambda: guard(node, RecordDict(), cfg, instruction), lambda: hello_check(node, RecordDict(), cfg, 9)):
        with pytest.raises(NoiseRefused, match="draws seeded noise.*regenerate it.*protect nothing"):
            check()


def test_methods_and_runs_that_give_no_bound_against_the_server_are_refused(tmp_path):
    cfg, instruction = _plan()
    node = _limited(tmp_path, 3.0)
    with pytest.raises(NoiseRefused, match="without privacy"):
        guard(node, RecordDict(), cfg, instruction)
    dpfpl = validate({"method": "dpfpl", "privacy.epsilon": 2.0})
    for check in (
        lambda: guard(node, RecordDict(), dpfpl, instruction),
        lambda: hello_check(node, RecordDict(), dpfpl, 9),
    ):
        with pytest.raises(NoiseRefused, match="un-noised updates"):
            check()


# ---- one ledger across every run ---------------------------------------------------------------


def test_a_second_run_that_would_pass_the_limit_is_refused_at_the_handshake(tmp_path):
    """Two 1-round runs at epsilon 2.9 on the same records compose to about 3.5: under a limit of 3
    the first trains and the second is refused, at the handshake and at its round, with the
    epsilon spent; the ledger is on the node's disk, not in either run's state."""
    cfg, instruction = _plan(rounds=1, **{"privacy.epsilon": 2.9})
    node = _limited(tmp_path, 3.0)
    hello_check(node, RecordDict(), cfg, N_TRAIN)
    assert _train(node, RecordDict(), cfg, _at(instruction, 1, "/runs/first")) == pytest.approx(2.9, rel=1e-2)
    second = _at(instruction, 1, "/runs/second")
    with pytest.raises(
        NoiseRefused, match=r"have spent epsilon = 2\.9\d* of this node's limit.*1 earlier run.*bring them to 3\.4"
    ):
        hello_check(node, RecordDict(), cfg, N_TRAIN)
    with pytest.raises(NoiseRefused, match=r"plan would spend epsilon = 3\.4\d* .*after what 1 earlier run"):
        guard(node, RecordDict(), cfg, second)
    # a wiped run folder or a resumed one changes nothing: the same run folder's name again
    with pytest.raises(NoiseRefused):
        guard(node, RecordDict(), cfg, _at(instruction, 1, "/runs/first"))
    files = list((tmp_path / "state" / "ledgers").glob("*.json"))
    saved = json.loads(files[0].read_text())
    assert len(files) == 1 and [r["run"] for r in saved["rows"]] == ["/runs/first"]
    assert (files[0].stat().st_mode & 0o077) == 0 and (files[0].parent.stat().st_mode & 0o777) == 0o700


def test_the_ledger_is_per_data_whichever_node_trains_on_it(tmp_path):
    cfg, instruction = _plan(rounds=1, **{"privacy.epsilon": 2.0})
    folder = tmp_path / "images"
    common = {"max-epsilon": 3.0, "delta": 1e-5, "state-dir": str(tmp_path / "state"), "data-dir": str(folder)}
    a = _node({**common, "name": "a"}, name="a", partition_id=-1)
    b = _node({**common, "name": "b"}, name="b", partition_id=-1)
    _train(a, RecordDict(), cfg, _at(instruction, 1, "/runs/one"))
    assert len(ledger(b, RecordDict()).rows()) == 1  # the same folder: the same records, one ledger
    other = _node({**common, "data-dir": str(tmp_path / "other")}, partition_id=-1)
    assert ledger(other, RecordDict()).rows() == []


def test_one_folder_reached_through_a_symlink_keeps_its_one_ledger(tmp_path):
    """The data folder through a symlink started a fresh ledger (10 releases, epsilon 3.72 against
    a limit of 3): the ledger is the records' (their resolved folder), found whatever name its file
    was first written under, and two files for one folder are refused, not guessed between."""
    cfg, instruction = _plan(rounds=1, **{"privacy.epsilon": 2.0})
    folder, link = tmp_path / "images", tmp_path / "link"
    folder.mkdir()
    link.symlink_to(folder)
    common = {"max-epsilon": 3.0, "delta": 1e-5, "state-dir": str(tmp_path / "state")}
    _train(_node({**common, "data-dir": str(link)}, partition_id=-1), RecordDict(), cfg, _at(instruction, 1, "/r/1"))
    direct = _node({**common, "data-dir": str(folder)}, partition_id=-1)
    assert len(ledger(direct, RecordDict()).rows()) == 1
    # a ledger first written under the symlink's name (before the file was named from the
    # resolved folder) is still this folder's
    (written,) = (tmp_path / "state" / "ledgers").glob("*.json")  # not its lock file
    assert written.name.startswith("images-")  # named from the resolved folder
    key = written.name.removeprefix("images-")
    old = written.rename(written.with_name("link-" + key))
    assert len(ledger(direct, RecordDict()).rows()) == 1
    (old.with_name("images-" + key)).write_text(old.read_text())
    with pytest.raises(ConfigError, match="2 privacy ledgers.*merge their rows into one file"):
        ledger(direct, RecordDict())


def test_two_runs_at_once_cannot_both_spend_the_rest(tmp_path):
    """Both pass the check before training; the second to finish finds the first's row under the
    ledger's lock and its reply stays on the node."""
    cfg, instruction = _plan(rounds=1, **{"privacy.epsilon": 2.9})
    node = _limited(tmp_path, 3.0)
    one, two = (guard(node, RecordDict(), cfg, _at(instruction, 1, run)) for run in ("/runs/x", "/runs/y"))
    assert one is not None and two is not None
    outcomes: list[object] = []

    def finish(release) -> None:
        try:
            outcomes.append(record(node, RecordDict(), cfg, release))
        except NoiseRefused as refused:
            outcomes.append(refused)

    threads = [threading.Thread(target=finish, args=(r,)) for r in (one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(o, float) for o in outcomes) == 1 and sum(isinstance(o, NoiseRefused) for o in outcomes) == 1
    assert len(ledger(node, RecordDict()).rows()) == 1


def test_a_damaged_ledger_is_refused_not_forgotten(tmp_path):
    cfg, instruction = _plan(rounds=1, **{"privacy.epsilon": 1.0})
    node = _limited(tmp_path, 3.0)
    _train(node, RecordDict(), cfg, instruction)
    path = next((tmp_path / "state" / "ledgers").glob("*.json"))
    path.write_text(path.read_text()[:40])
    with pytest.raises(ConfigError, match="privacy ledger .* cannot be read.*restore it from a backup; do not delete"):
        hello_check(node, RecordDict(), cfg, N_TRAIN)


def test_a_client_with_privacy_on_and_no_mechanism_refuses_rather_than_trains_without_noise():
    # validate refuses such a method; client_plan, handed the mechanism, still fails closed on its own
    cfg, instruction = _plan(**{"privacy.epsilon": 8.0})
    shape, sigma = client_plan(cfg, spec_of(cfg).local_dp, N_TRAIN, instruction)
    assert shape == ClientShape(N_TRAIN, BATCH, 1) and sigma > 0
    with pytest.raises(NoiseRefused, match="no local-DP mechanism; refusing to train without noise"):
        client_plan(cfg, None, N_TRAIN, instruction)
