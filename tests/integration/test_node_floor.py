"""A node enforces its own privacy floor in a federation: it trains under a plan within its
limit (and its own account agrees with the server's ledger), and refuses a server that weakens
the privacy config, with the numbers; nodes without a floor are unaffected."""

from __future__ import annotations

import pytest
import torch

from fedvlm.client_app.app import app as client_app
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid

FLOOR = {"max-epsilon": 3.0, "delta": 1e-5}


def _run(make_cfg, epsilon, name):
    cfg = make_cfg(method="promptfl", num_server_rounds=2, max_per_class=6, privacy__epsilon=epsilon, run_name=name)
    nodes = [{"partition-id": i, "num-partitions": 3, **(FLOOR if i < 2 else {})} for i in range(3)]
    return execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id=name)


def test_a_node_trains_within_its_floor_and_refuses_a_weakened_plan(make_cfg, pretrained_clip):
    honest = _run(make_cfg, 2.0, "honest")
    for r, spent in zip(honest.data["rounds"], honest.data["privacy"]["rounds"], strict=True):
        assert r["metrics"]["train-clients"] == 3 and not r["dropped"]
        for client in ("client-0", "client-1"):  # the node's own account is the server's ledger's
            assert r["clients"][client]["train/node-epsilon"] == pytest.approx(spent["per_client"][client], rel=1e-6)
        assert "train/node-epsilon" not in r["clients"]["client-2"]
    saved = torch.load(honest.dir / "nodes" / "client-0" / "round-0002.pt", weights_only=True)["records"]
    assert saved["node-ledger"][1]["round"] == [1, 2]  # kept with the node's state

    weakened = _run(make_cfg, 50.0, "weakened")  # config and sigma agree: only the node's own limit stops it
    for r in weakened.data["rounds"]:
        reasons = {d["client"]: d["reason"] for d in r["dropped"]}
        assert sorted(reasons) == ["client-0", "client-1"] and r["metrics"]["train-clients"] == 1
        assert all(
            "plan would spend epsilon = 50 per record" in why and "max-epsilon = 3" in why for why in reasons.values()
        )
    assert weakened.data["run"]["status"] == "finished"
