"""A node enforces its own privacy floor in a federation: it trains under a plan within its
limit (and its own account agrees with the server's ledger), and refuses a server that weakens
the privacy config, with the numbers, and a run that would take its records past the limit
after what earlier runs spent (its ledger on its own disk, whatever happened to the server's run
folders); nodes without a floor are unaffected."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from flwr.app import MessageType

from fedvlm.client_app.app import app as client_app
from fedvlm.privacy.mechanisms import gaussian_noise, noise_generator
from fedvlm.protocol import LOCAL_SIGMA
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid
from fedvlm.utils.rng import NodeStream, node_key, node_seed

FLOOR = {"max-epsilon": 3.0, "delta": 1e-5}


def _run(make_cfg, epsilon, name, state, rounds=2):
    """Three partition nodes, the first two with a limit (and their ledgers under ``state``)."""
    cfg = make_cfg(
        method="promptfl",
        num_server_rounds=rounds,
        max_per_class=6,
        privacy__epsilon=epsilon,
        run_name=name,
        min_nodes=1,  # the node without a limit carries on where the others refuse
    )
    nodes = [
        {"partition-id": i, "num-partitions": 3, **({**FLOOR, "state-dir": str(state / f"n{i}")} if i < 2 else {})}
        for i in range(3)
    ]
    return execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict(), simulation=True), run_id=name)


def test_a_node_trains_within_its_floor_and_refuses_a_weakened_plan(make_cfg, pretrained_clip, tmp_path):
    honest = _run(make_cfg, 2.0, "honest", tmp_path / "honest")
    for r, spent in zip(honest.data["rounds"], honest.data["privacy"]["rounds"], strict=True):
        assert r["metrics"]["train-clients"] == 3 and not r["dropped"]
        for client in ("client-0", "client-1"):  # the node's own account is the server's ledger's
            assert r["clients"][client]["train/node-epsilon"] == pytest.approx(spent["changed"][client], rel=1e-6)
        assert "train/node-epsilon" not in r["clients"]["client-2"]
    (ledger,) = (tmp_path / "honest" / "n0" / "ledgers").glob("*.json")  # on the node's own disk
    assert [r["round"] for r in json.loads(ledger.read_text())["rows"]] == [1, 2]
    saved = torch.load(honest.dir / "nodes" / "client-2" / "round-0002.pt", weights_only=True)["records"]
    assert saved["node-ledger"][1]["round"] == [1, 2]  # a node without a state-dir: kept with its state

    # config and sigma agree: only the node's own limit stops it, at the handshake
    weakened = _run(make_cfg, 50.0, "weakened", tmp_path / "weakened")
    excluded = weakened.data["run"]["excluded_nodes"]  # by node id: a refused handshake names no node
    assert len(excluded) == 2, excluded
    assert all("would bring them to 50" in why and "max-epsilon = 3" in why for why in excluded.values())
    assert all(r["metrics"]["train-clients"] == 1 for r in weakened.data["rounds"])
    assert weakened.data["run"]["status"] == "finished"


def test_the_limit_spans_every_run_on_the_same_records(make_cfg, pretrained_clip, tmp_path):
    """Two one-round runs at epsilon 2.9 on the same records compose past a limit of 3: the second
    run is refused at the handshake with what the first spent, also after the server wiped its
    run folders and started again under the same name."""
    state = tmp_path / "state"
    first = _run(make_cfg, 2.9, "first", state, rounds=1)
    assert first.data["rounds"][0]["metrics"]["train-clients"] == 3
    for attempt in ("second", "first"):  # a new run; the first run's folder wiped and run again
        shutil.rmtree(first.dir, ignore_errors=True)
        again = _run(make_cfg, 2.9, attempt, state, rounds=1)
        excluded = again.data["run"]["excluded_nodes"]
        assert len(excluded) == 2, excluded
        for why in excluded.values():
            assert "have spent epsilon = 2.9" in why and "1 earlier run(s)" in why and "max-epsilon = 3" in why, why
        assert again.data["rounds"][0]["clients"].keys() == {"client-2"}  # the node without a limit trains
    for node in ("n0", "n1"):  # one release each: nothing refused was counted
        (ledger,) = (state / node / "ledgers").glob("*.json")
        assert len(json.loads(ledger.read_text())["rows"]) == 1


def test_the_noise_of_a_node_with_a_limit_cannot_be_regenerated_from_the_run_config(
    make_cfg, pretrained_clip, tmp_path
):
    """The audit's attack: with the run config, regenerate a node's seeded noise and subtract it
    from what the node released (one SGD step at learning rate 1: the upload is the initial prompt
    minus the noised gradient). Against a plain partition node it works (what is left is the clean
    gradient); against a node that states a limit it moves the release further away."""
    cfg = make_cfg(
        method="promptfl",
        num_server_rounds=1,
        max_per_class=6,
        privacy__epsilon=1.0,
        prompt__optimizer="sgd",
        prompt__lr=1.0,
        prompt__momentum=0.0,
        prompt__weight_decay=0.0,
        run_name="regen",
    )
    limited = {"partition-id": 0, "num-partitions": 2, **FLOOR, "state-dir": str(tmp_path / "state")}
    nodes = [limited, {"partition-id": 1, "num-partitions": 2}]
    grid = InProcessGrid(client_app, nodes, cfg.as_dict())
    rec = execute(cfg, grid, run_id="regen")
    assert rec.data["privacy"]["noise_sources"]["clients"] == {"client-0": "os", "client-1": "seeded"}
    left = {}
    trains = [[m for m in ms if m.metadata.message_type == MessageType.TRAIN] for ms in (grid.sent, grid.replies)]
    for request, reply in zip(*trains, strict=True):  # the in-process grid answers in order
        pid = request.metadata.dst_node_id - 1000
        sent, uploaded = request.content["arrays"]["ctx"].numpy(), reply.content["arrays"]["ctx"].numpy()
        released = torch.from_numpy(sent - uploaded)  # the noised, clipped gradient
        key = node_key(cfg.seed, node_seed(pid, f"client-{pid}"), NodeStream.LOCAL_NOISE, 1)
        sigma = float(request.content["config"][LOCAL_SIGMA])
        regenerated = gaussian_noise(released.shape, sigma, noise_generator("seeded", key))
        left[pid] = (float((released - regenerated).norm()), float(released.norm()), float(regenerated.norm()))
    after, before, noise = left[1]
    assert after < 0.5 * before and after <= cfg.privacy.clip * 2  # the control: the noise comes off
    after, before, noise = left[0]
    assert after > before > 0.8 * noise  # the limited node: subtracting adds a second noise instead
