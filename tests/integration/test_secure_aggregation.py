"""Secure aggregation in a real federation (``fedvlm.secagg``, ``strategies.secure_sum``): the
round's four stages run over Flower's Message API, the server aggregates only the survivors' sum,
and the result is the aggregate it would have computed from the clear updates."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Error, Message

from fedvlm.attacks.server import ServerAttack
from fedvlm.client_app import secure_aggregation
from fedvlm.client_app.app import app as client_app
from fedvlm.metrics import EPSILON_SPENT, NUM_EXAMPLES
from fedvlm.protocol import (
    ARRAYS_RECORD,
    METRICS_RECORD,
    SECAGG_CLIENT_SIGMA,
    SECAGG_MASKED,
    SECAGG_NODES,
    SECAGG_SEED_SHARES,
    SECAGG_STAGE,
    SECURE_SUM,
)
from fedvlm.secagg import stages
from fedvlm.server_app.app import execute
from fedvlm.server_app.observer import load_rounds
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
        # round 1 keys afresh; round 2 is keyed with the prekeys round 1's replies carried: no shares stage
        assert protocol["prekeyed"] is (r["round"] > 1)
        assert ("shares" in protocol["stage_seconds"]) is (r["round"] == 1), protocol["stage_seconds"]
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
    shares = plan["distributed"]
    assert plan["party"] == "clients" and plan["sampling_rate"] == 1.0  # no amplification claimed
    assert not any("sees each client's un-noised" in n for n in ledger["notes"])  # no one sees one now
    assert any(n.startswith("secure aggregation: the server sees no client's gradient") for n in ledger["notes"])
    # every round's sum carried the shares of n_min or more survivors, as planned
    for r in data["rounds"]:
        noise = r["secure_aggregation"]["noise"]
        assert noise["client_sigma"] == pytest.approx(shares["client_sigma"]) and noise["n_min"] == shares["n_min"]
        assert r["secure_aggregation"]["masked"] >= shares["n_min"] and noise["wrap_probability"] < 1e-9
    # the ledger's per-record epsilon, recomputed here from its own parameters with the analysis
    # written out (Kairouz et al.'s bound, Mironov's subsampled Gaussian from dp-accounting's
    # RDP orders, Canonne et al.'s conversion)
    from dp_accounting.rdp import RdpAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_poisson_subsampled_gaussian

    orders = np.asarray(RdpAccountant()._orders, dtype=float)
    rounds = data["config"]["num-server-rounds"]
    for name, account in ledger["records"].items():
        gamma, d, n_min, sigma_c = shares["gamma"], shares["dim"], shares["n_min"], shares["client_sigma"]
        s = plan["true_sensitivity"] * shares["denominator"]  # a record's move of its client's upload
        rho = (s / gamma + math.sqrt(d)) ** 2 / (2 * n_min * sigma_c**2)
        xi = 10 * sum(math.exp(-2 * math.pi**2 * sigma_c**2 * k / (k + 1)) for k in range(1, n_min)) * d
        assert account["zcdp_rho"] == pytest.approx(rho, rel=1e-9) and account["zcdp_xi"] == pytest.approx(xi)
        local = _compute_rdp_poisson_subsampled_gaussian(account["sampling_rate"], account["z_local"], orders)
        rdp = rounds * account["steps_per_round"] * np.asarray(local) + rounds * (xi + rho * orders)
        ok = orders > 1.01
        eps = rdp[ok] + np.log1p(-1 / orders[ok]) - np.log(plan["delta"] * orders[ok]) / (orders[ok] - 1)
        assert account["planned_epsilon"] == pytest.approx(float(eps.min()), rel=1e-6), name
        assert account["planned_epsilon"] <= 4.0 * (1 + 1e-9)
    assert data["rounds"][-1]["metrics"][EPSILON_SPENT] == pytest.approx(ledger["rounds"][-1]["epsilon"])


def _stage(request: Message) -> str:
    return str(request.content[SECURE_SUM][SECAGG_STAGE]) if SECURE_SUM in request.content else ""


def _secure_run(make_cfg, run_id, intercept=None, n=5, method="promptfl", **overrides):
    cfg = make_cfg(
        method=method,
        num_server_rounds=1,
        max_per_class=6,
        replies__max_norm=100.0,
        secure_aggregation__enabled=True,
        reply_grace=0.2,
        **overrides,
    )
    grid = InProcessGrid(
        client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], cfg.as_dict(), intercept=intercept
    )
    rec = execute(cfg, grid, run_id=run_id)
    return rec, json.loads(rec.path.read_text()), grid


def _capture_updates(monkeypatch) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
    """node id -> (the prompt it was sent, its update, its weight), from the clear reply the
    handlers hand to the secure-aggregation layer, which encodes it."""
    seen = {}
    first_stage = secure_aggregation._first_stage

    def spy(msg, context, inner):
        def watching(m, c):
            reply = inner(m, c)
            sent = msg.content[ARRAYS_RECORD][CTX].numpy()
            returned = reply.content[ARRAYS_RECORD][CTX].numpy()
            seen[context.node_id] = (sent, returned - sent, int(reply.content[METRICS_RECORD][NUM_EXAMPLES]))
            return reply

        return first_stage(msg, context, watching)

    monkeypatch.setattr(secure_aggregation, "_first_stage", spy)
    return seen


@pytest.mark.parametrize("stage", ["keys", "shares", "consistency", "unmask"])
def test_a_node_dropping_out_at_any_stage_leaves_the_survivors_exact_sum(make_cfg, pretrained_clip, monkeypatch, stage):
    dropped = 1001  # partition 1's node

    def drop(request, reply):
        if request.metadata.dst_node_id == dropped and _stage(request) == stage:
            return Message(Error(code=0, reason="gone"), reply_to=request)
        return reply

    seen = _capture_updates(monkeypatch)
    rec, data, grid = _secure_run(make_cfg, f"drop-{stage}", drop)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert data["run"]["status"] == "finished" and "failed" not in protocol
    in_sum = set(seen) - ({dropped} if stage in ("keys", "shares") else set())  # lost after its vector: summed
    assert protocol["masked"] == len(in_sum) and len(seen) == 5
    # the aggregate is the weighted average of the clear updates the survivors encoded
    sent = next(iter(seen.values()))[0]
    weights = sum(seen[n][2] for n in in_sum)
    expected = sent + sum(seen[n][2] * seen[n][1] for n in in_sum) / weights
    final = torch.load(rec.dir / "final_shared.pt", weights_only=True)["arrays"][CTX].numpy()
    np.testing.assert_allclose(final, expected, atol=1e-5)


def _final(rec) -> np.ndarray:
    return torch.load(rec.dir / "final_shared.pt", weights_only=True)["arrays"][CTX].numpy()


def test_forged_shares_are_left_out_or_discard_the_round_never_a_wrong_sum(make_cfg, pretrained_clip, monkeypatch):
    seen = _capture_updates(monkeypatch)

    def forge_one(request, reply):  # node 1000 (in every first try) returns random shares of every seed
        if request.metadata.dst_node_id == 1000 and _stage(request) == "unmask":
            record = reply.content[SECURE_SUM]
            record[SECAGG_SEED_SHARES] = [s[:4] + os.urandom(len(s) - 4) for s in record[SECAGG_SEED_SHARES]]
        return reply

    rec, data, _ = _secure_run(make_cfg, "forged-one", forge_one)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert "failed" not in protocol and "1000" in protocol["forged_shares"]
    weights = sum(w for _, _, w in seen.values())
    sent = next(iter(seen.values()))[0]
    np.testing.assert_allclose(_final(rec), sent + sum(w * u for _, u, w in seen.values()) / weights, atol=1e-5)

    def forge_all(request, reply):  # every holder but one forges node 1000's seed share
        if request.metadata.dst_node_id != 1001 and _stage(request) == "unmask":
            record = reply.content[SECURE_SUM]
            owners = [int(n) for n in record[SECAGG_NODES]]
            shares = zip(owners, record[SECAGG_SEED_SHARES], strict=True)
            record[SECAGG_SEED_SHARES] = [s[:4] + os.urandom(len(s) - 4) if o == 1000 else s for o, s in shares]
        return reply

    seen.clear()
    rec, data, _ = _secure_run(make_cfg, "forged-all", forge_all)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert "cannot be rebuilt" in protocol["failed"] and "node 1000's seed" in protocol["failed"]
    np.testing.assert_array_equal(_final(rec), next(iter(seen.values()))[0])  # the round changed nothing


def test_a_malformed_vector_excludes_its_sender_and_the_rest_sum_exactly(make_cfg, pretrained_clip, monkeypatch):
    seen = _capture_updates(monkeypatch)

    def shorten(request, reply):
        if request.metadata.dst_node_id == 1002 and _stage(request) == "shares":  # the vector goes with them
            vector = reply.content[ARRAYS_RECORD][SECAGG_MASKED].numpy()
            reply.content[ARRAYS_RECORD] = ArrayRecord({SECAGG_MASKED: Array(vector[:-1].copy())})
        return reply

    rec, data, _ = _secure_run(make_cfg, "malformed", shorten)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert "not a flat uint32/64" in protocol["excluded"]["1002"] and protocol["masked"] == 4
    rest = {n: v for n, v in seen.items() if n != 1002}
    weights = sum(w for _, _, w in rest.values())
    sent = next(iter(rest.values()))[0]
    np.testing.assert_allclose(_final(rec), sent + sum(w * u for _, u, w in rest.values()) / weights, atol=1e-5)


def test_the_servers_view_is_masked_vectors_and_its_attack_has_nothing_per_client(make_cfg, pretrained_clip):
    rec, data, _ = _secure_run(make_cfg, "observed", attack__observe_uploads=True)
    (round_one,) = load_rounds(rec.dir)
    for uploaded in round_one.uploaded.values():
        assert set(uploaded) == {SECAGG_MASKED}  # no prompt, no gradient: the vector under its masks
        vector = uploaded[SECAGG_MASKED].numpy().astype(np.float64) / 2.0**32  # the default bits
        assert abs(vector.mean() - 0.5) < 0.05 and abs(vector.var() - 1 / 12) < 0.01  # uniform on [0, 1)
    cfg = make_cfg(method="promptfl", max_per_class=6)
    with pytest.raises(ValueError, match="secure aggregation.*no per-client upload to attack"):
        ServerAttack(cfg, 5, seed=0).scores(rec.dir)


def test_nodes_hold_the_server_to_their_own_terms(make_cfg, pretrained_clip, monkeypatch):
    # a node that requires secure aggregation refuses a run without it, at the handshake
    cfg = make_cfg(method="promptfl", num_server_rounds=1, max_per_class=6)
    nodes = [{"partition-id": i, "num-partitions": 3} for i in range(3)]
    nodes[0]["require-secure-aggregation"] = "true"
    rec = execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id="required")
    data = json.loads(rec.path.read_text())
    assert "requires secure aggregation" in str(data["run"]["excluded_nodes"])
    # a server that asks for a weaker noise share than the run promises is refused by every node
    to_config = stages.SumPlan.to_config
    monkeypatch.setattr(
        stages.SumPlan, "to_config", lambda plan: {**to_config(plan), SECAGG_CLIENT_SIGMA: plan.client_sigma / 3}
    )
    rec, data, _ = _secure_run(make_cfg, "weak-noise", method="dpfpl", privacy__epsilon=4.0, n=4)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert protocol["advertised"] == 0 and "0 nodes advertised keys" in protocol["failed"]
    assert all("noise share" in d["reason"] for d in data["rounds"][0]["dropped"])


def test_a_round_too_small_to_sum_securely_trains_no_one(make_cfg, pretrained_clip):
    """Three nodes and a configured threshold of five: no round can be unmasked, so none is sent
    for training (a train message without its secure plan would have its update sent in clear);
    each round says why, and the run ends with its evaluations."""
    rec, data, grid = _secure_run(make_cfg, "too-small", n=3, secure_aggregation__threshold=5)
    assert data["run"]["status"] == "finished"
    for r in data["rounds"]:
        assert r["sampled"] == 0 and "too few for a threshold of 5" in r["secure_aggregation"]["failed"]
    assert not any(m.metadata.message_type == "train" for m in grid.sent)
