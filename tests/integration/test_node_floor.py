"""A node enforces its own privacy floor in a federation: it trains under a plan within its
limit (and its own account agrees with the server's ledger), and refuses a server that weakens
the privacy config, with the numbers; nodes without a floor are unaffected."""

from __future__ import annotations

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


def test_the_noise_of_a_node_with_a_limit_cannot_be_regenerated_from_the_run_config(make_cfg, pretrained_clip):
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
    nodes = [{"partition-id": 0, "num-partitions": 2, **FLOOR}, {"partition-id": 1, "num-partitions": 2}]
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
