"""pFedMoAP in one process (real strategy, real ClientApp, real Flower messages, tiny CLIP):
the pool and its snapshot, KNN experts, first participation, the private gate, dropped
replies, and its DP mechanisms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedvlm.client_app.app import app as client_app
from fedvlm.client_app.state import PRIVATE
from fedvlm.protocol import SERVER_ROUND
from fedvlm.server_app.app import execute
from fedvlm.spec import spec_of
from fedvlm.strategies.nodes import NodeInfo
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.pfedmoap import nearest
from fedvlm.utils.inprocess import InProcessGrid

N, K, ROUNDS, VICTIM_ROUND = 4, 2, 3, 3


def _arrays(record) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.numpy()) for k, v in record.items()}


@pytest.fixture(scope="module")
def moap_run(tmp_path_factory, cache_dir, pretrained_clip):
    """3 rounds, 4 clients, K = 2 (fewer than the 3 others, so KNN chooses); in round 3 the
    first node's reply is corrupted and must be dropped."""
    from fedvlm.methods.validation import validate

    cfg = validate(
        {
            "method": "pfedmoap",
            "pfedmoap.k": K,
            "num-server-rounds": ROUNDS,
            "max-per-class": 4,
            "cache-dir": str(cache_dir),
            "output-dir": str(tmp_path_factory.mktemp("runs")),
        }
    )
    seen: list[dict] = []  # one entry per message: round, phase, node, what was sent and returned, private keys
    victim = 1000

    def spy(req, reply):
        rnd = int(req.content["config"][SERVER_ROUND]) if "config" in req.content else 0
        state = grid.contexts[req.metadata.dst_node_id].state
        private = {k: v.clone() for k, v in state[PRIVATE].to_torch_state_dict().items()} if PRIVATE in state else {}
        phase = req.metadata.message_type
        if phase == "train" and rnd == VICTIM_ROUND and req.metadata.dst_node_id == victim:
            bad = reply.content["arrays"]["ctx"].numpy().copy()
            bad[0, 0] = np.nan
            from flwr.app import Array, ArrayRecord

            reply.content["arrays"] = ArrayRecord({"ctx": Array(bad)})
        seen.append(
            {
                "round": rnd,
                "phase": phase,
                "node": req.metadata.dst_node_id,
                "down": _arrays(req.content["arrays"]) if "arrays" in req.content else {},
                "up": {} if reply.has_error() else _arrays(reply.content["arrays"]),
                "examples": None if reply.has_error() else reply.content["metrics"].get("num-examples"),
                "private": private,
            }
        )
        return reply

    grid = InProcessGrid(
        client_app, [{"partition-id": i, "num-partitions": N} for i in range(N)], cfg.as_dict(), intercept=spy
    )
    rec = execute(cfg, grid, run_id="moap")
    return rec, seen, victim


def _of(seen, phase, rnd):
    return {m["node"]: m for m in seen if m["phase"] == phase and m["round"] == rnd}


def test_first_participation_is_plain_and_later_rounds_get_knn_experts_from_the_snapshot(moap_run):
    rec, seen, _ = moap_run
    assert rec.data["run"]["status"] == "finished" and len(rec.data["rounds"]) == ROUNDS
    # the run names the CLIP it loaded, its pretrained tag and the weights every node reported loading
    backbone = rec.data["run"]["backbone"]
    assert backbone["name"] == "embedded-tiny" and backbone["pretrained"].startswith("embedded")
    assert {n["backbone"] for n in rec.data["run"]["nodes"]} == {backbone["fingerprint"]}
    first = _of(seen, "train", 1)
    assert len(first) == N and all(set(m["down"]) == {"ctx"} for m in first.values())
    assert not any(k.startswith("gate") for m in first.values() for k in m["private"])  # no gate yet
    pool = {n: m["up"]["ctx"] for n, m in first.items()}  # every accepted reply entered the pool
    for rnd in range(2, ROUNDS + 1):
        train = _of(seen, "train", rnd)
        for node, m in train.items():
            others = {n: p for n, p in pool.items() if n != node}
            want = np.stack([others[n] for n in nearest(pool[node], others, K)])
            assert m["down"]["experts"].shape[0] == K
            np.testing.assert_array_equal(np.sort(m["down"]["experts"], axis=0), np.sort(want, axis=0))
        # the round's replies enter the pool only after it (a corrupted one never)
        pool.update({n: m["up"]["ctx"] for n, m in train.items() if np.isfinite(m["up"]["ctx"]).all()})


def test_the_gate_is_private_persists_and_never_leaves_the_node(moap_run):
    _, seen, _ = moap_run
    second, third = _of(seen, "train", 2), _of(seen, "train", 3)
    for node in second:
        gate2 = {k: v for k, v in second[node]["private"].items() if k.startswith("gate.")}
        gate3 = {k: v for k, v in third[node]["private"].items() if k.startswith("gate.")}
        assert gate2 and set(gate2) == set(gate3)  # created in the first round with experts, kept
        assert any(k.startswith("gate-opt.") for k in third[node]["private"])  # its optimiser state too
        assert any(not torch.equal(gate2[k], gate3[k]) for k in gate2)  # and it trains
    private = [v.numpy() for m in seen for v in m["private"].values()]
    for m in seen:
        assert set(m["up"]) <= {"ctx"}
        for up in m["up"].values():
            assert not any(p.shape == up.shape and np.array_equal(p, up) for p in private if p.ndim == up.ndim)


def test_aggregate_is_the_weighted_mean_and_a_dropped_reply_keeps_the_old_pool_entry(moap_run):
    rec, seen, victim = moap_run
    last = _of(seen, "train", ROUNDS)
    kept = {n: m for n, m in last.items() if n != victim}
    weights = np.array([m["examples"] for m in kept.values()], dtype=float)
    want = sum(w * m["up"]["ctx"].astype(np.float64) for w, m in zip(weights, kept.values(), strict=True))
    final = torch.load(rec.dir / "final_shared.pt", weights_only=True)["arrays"]["ctx"].numpy()
    np.testing.assert_allclose(final, want / weights.sum(), rtol=1e-5, atol=1e-6)
    assert any(d["client"] == "client-0" for d in rec.data["rounds"][-1]["dropped"])
    # evaluated with its own pool prompt: the last accepted upload, from the round before
    evaluated = _of(seen, "evaluate", ROUNDS)[victim]["down"]["ctx"]
    np.testing.assert_array_equal(evaluated, _of(seen, "train", ROUNDS - 1)[victim]["up"]["ctx"])
    assert "experts" in _of(seen, "evaluate", ROUNDS)[victim]["down"]


def test_random_selection_is_seeded_and_differs_per_node_and_round(make_cfg, pretrained_clip):
    cfg = make_cfg(method="pfedmoap", pfedmoap__k=3, pfedmoap__selection="random")
    strategy = spec_of(cfg).strategy(RunParts.of(cfg))
    nodes = [NodeInfo(i, f"c{i}", i, 64, 24, 0, "x", 40) for i in range(8)]
    pool = {n.name: np.full((2, 2), i, np.float32) for i, n in enumerate(nodes)}
    draws = {(n.name, r): tuple(strategy.experts(n, pool, r)) for n in nodes for r in (1, 2, 3)}
    assert all(len(d) == 3 and name not in d for (name, _), d in draws.items())
    again = spec_of(cfg).strategy(RunParts.of(cfg))
    assert draws == {(n.name, r): tuple(again.experts(n, pool, r)) for n in nodes for r in (1, 2, 3)}
    assert len({d for (name, _), d in draws.items() if name == "c0"}) > 1  # per round
    assert len({d for (_, r), d in draws.items() if r == 1}) > 1  # per node


def test_k_bounds_what_a_node_receives_not_how_many_nodes_receive_a_prompt(make_cfg, pretrained_clip):
    """docs/privacy.md's threat model: one prompt can be every other node's nearest (here the centre of
    the pool), so with K = 1 it reaches all of them in one round."""
    cfg = make_cfg(method="pfedmoap", pfedmoap__k=1)
    strategy = spec_of(cfg).strategy(RunParts.of(cfg))
    nodes = [NodeInfo(i, f"c{i}", i, 64, 24, 0, "x", 40) for i in range(5)]
    axes = np.eye(4, dtype=np.float32).reshape(4, 2, 2)  # c0, c1, c3, c4 on four axes, c2 at the centre
    pool = {n.name: (np.zeros((2, 2), np.float32) if i == 2 else axes[i - (i > 2)]) for i, n in enumerate(nodes)}
    picked = [strategy.experts(n, pool, 1) for n in nodes if n.name != "c2"]
    assert all(len(p) == 1 for p in picked) and all(p == ["c2"] for p in picked)


def test_config_errors_name_the_key(make_cfg):
    from fedvlm.runconfig import ConfigError

    with pytest.raises(ConfigError, match="'pfedmoap.gating-dim' = 96 is not divisible by 'pfedmoap.gating-heads'"):
        make_cfg(method="pfedmoap", pfedmoap__gating_dim=96, pfedmoap__gating_heads=5)
    with pytest.raises(ConfigError, match="'pfedmoap.k' = -1: must be >= 0"):
        make_cfg(method="pfedmoap", pfedmoap__k=-1)
    cfg = make_cfg(method="pfedmoap", pfedmoap__gating_dim=96, pfedmoap__gating_heads=8)
    with pytest.raises(ConfigError, match="must divide the embedding dimension"):
        spec_of(cfg).strategy(RunParts.of(cfg))


def _dp_run(make_cfg, placement: str, **extra):
    """Two rounds under DP, plain SGD with lr 1 and a vanishing clip on the prompt, so the uploaded
    change of the prompt is the noise alone (what the plan says the node draws)."""
    cfg = make_cfg(
        method="pfedmoap",
        num_server_rounds=2,
        max_per_class=4,
        privacy__epsilon=1.0,
        pfedmoap__dp_placement=placement,
        prompt__optimizer="sgd",
        prompt__momentum=0.0,
        prompt__weight_decay=0.0,
        prompt__lr=1.0,
        **extra,
    )
    ups: list[tuple[np.ndarray, np.ndarray]] = []

    def spy(req, reply):
        if req.metadata.message_type == "train" and not reply.has_error():
            ups.append((req.content["arrays"]["ctx"].numpy(), reply.content["arrays"]["ctx"].numpy()))
        return reply

    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": N} for i in range(N)], cfg.as_dict(), spy)
    return execute(cfg, grid, run_id=placement), ups


@pytest.mark.parametrize("placement,mechanism", [("step", "ldp-prompt-gate"), ("upload", "ldp-upload")])
def test_dp_plans_the_mechanism_and_the_upload_carries_the_noise(make_cfg, pretrained_clip, placement, mechanism):
    rec, ups = _dp_run(make_cfg, placement, privacy__clip=1e-6)
    privacy = rec.data["privacy"]
    plans = [p for per in privacy["client_mechanisms"].values() for p in per.values()]
    assert plans and all(p["name"] == mechanism for p in plans)
    notes = " ".join(n for p in plans for n in p["notes"])
    if placement == "step":  # the prompt and the gate, one noise level, and why the gate is noised
        assert "2 tensors are clipped to C separately" in notes and "the gate is noised too" in notes
        assert all(p["releases"] == 2 for p in plans)  # one local step per round under DP
    else:  # once per round, sensitivity 2C, no amplification, and what it does not cover
        assert "NOT the node's own personalised model" in notes
        assert all(p["releases"] == 2 and p["sampling_rate"] == 1.0 for p in plans)
        assert all(np.isclose(p["sensitivity"], 2e-6) for p in plans)
    sigma = plans[0]["sigma"]
    assert all(np.isclose(p["sigma"], sigma) for p in plans)  # equal data sizes, equal plans
    # one step (or one upload) of size sigma per round: the change of the prompt is the noise
    changes = np.concatenate([(up - down).ravel() for down, up in ups])
    assert abs(changes.std() / sigma - 1) < 0.05, (changes.std(), sigma)
    assert rec.data["rounds"][-1]["metrics"]["local-acc"] > 0
