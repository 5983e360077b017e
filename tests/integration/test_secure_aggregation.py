"""Secure aggregation in a real federation (``fedvlm.secagg``, ``strategies.secure_sum``): the
round's four stages run over Flower's Message API, the server aggregates only the survivors' sum,
and the result is the aggregate it would have computed from the clear updates."""

from __future__ import annotations

import json

import numpy as np
import torch

from fedvlm.client_app.app import app as client_app
from fedvlm.server_app.app import execute
from fedvlm.tensor_names import CTX
from fedvlm.utils.inprocess import InProcessGrid

N = 4


def _run(make_cfg, run_id, method_override="promptfl", **overrides):
    cfg = make_cfg(method=method_override, num_server_rounds=2, max_per_class=6, replies__max_norm=100.0, **overrides)
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": N} for i in range(N)], cfg.as_dict())
    rec = execute(cfg, grid, run_id=run_id)
    return rec, json.loads(rec.path.read_text())


def test_promptfl_under_secure_aggregation_aggregates_what_the_clear_run_does(make_cfg, pretrained_clip):
    clear, clear_data = _run(make_cfg, "clear")
    secure, data = _run(make_cfg, "secure", secure_aggregation__enabled=True)
    assert data["run"]["status"] == "finished"
    for r in data["rounds"]:
        protocol = r["secure_aggregation"]
        assert protocol["masked"] == N and protocol["revealed"] == N and not protocol["excluded"]
        assert r["bytes"]["train_up"] == 0  # no tensor in clear: the masked vectors are secure_up
        assert r["bytes"]["secure_up"] > 0
    a = torch.load(clear.dir / "final_shared.pt", weights_only=True)["arrays"][CTX].numpy()
    b = torch.load(secure.dir / "final_shared.pt", weights_only=True)["arrays"][CTX].numpy()
    np.testing.assert_allclose(b, a, atol=1e-6)
    assert abs(data["rounds"][-1]["metrics"]["local-acc"] - clear_data["rounds"][-1]["metrics"]["local-acc"]) < 1e-3


def test_dpfpl_under_secure_aggregation_has_its_clients_draw_the_global_noise(make_cfg, pretrained_clip):
    rec, data = _run(make_cfg, "dpfpl", method_override="dpfpl", privacy__epsilon=4.0, secure_aggregation__enabled=True)
    assert data["run"]["status"] == "finished"
    ledger = data["privacy"]
    (plan,) = ledger["mechanisms"].values()
    print(json.dumps(plan, indent=1)[:3000])
    print(json.dumps(ledger["records"], indent=1)[:1500])
    print(json.dumps(data["rounds"][-1]["secure_aggregation"], indent=1))
    assert plan["party"] == "clients"
