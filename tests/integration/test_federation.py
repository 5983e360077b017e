"""Whole federations in one process (the real strategies and the real ClientApp, messages as
Flower objects, no Ray): aggregation, private state, the send guard, dropped replies."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedvlm.client_app.app import app as client_app
from fedvlm.metrics import NUM_EXAMPLES
from fedvlm.protocol import SERVER_ROUND, TrainReply
from fedvlm.server_app.app import execute
from fedvlm.strategies.nodes import FederationError
from fedvlm.strategies.records import TRAFFIC_KEYS
from fedvlm.utils.inprocess import InProcessGrid

N = 10


def _run(make_cfg, n=N, intercept=None, node_configs=None, simulation=False, **overrides):
    cfg = make_cfg(**overrides)
    grid = InProcessGrid(
        client_app,
        node_configs or [{"partition-id": i, "num-partitions": n} for i in range(n)],
        cfg.as_dict(),
        intercept=intercept,
        simulation=simulation,
    )
    rec = execute(cfg, grid, run_id="test")
    return rec, grid


def _arrays_sent(grid, direction):
    msgs = grid.sent if direction == "down" else grid.replies
    return [set(m.content["arrays"].keys()) for m in msgs if not m.has_error() and "arrays" in m.content]


def test_promptfl_learns_and_writes_results(make_cfg, pretrained_clip):
    rec, grid = _run(make_cfg, method="promptfl", num_server_rounds=6)
    data = json.loads(rec.path.read_text())
    assert set(data) >= {"config", "run", "rounds", "final"}
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, 7))
    for r in rounds:
        assert set(r) >= {"round", "metrics", "seconds", *TRAFFIC_KEYS}
        assert len(r["clients"]) == N and not r["dropped"]
    acc = [r["metrics"]["local-acc"] for r in rounds]
    assert acc[-1] > acc[0] + 0.05, acc  # the learning curve rises
    # 10 clients x one 16x96 float32 prompt: up once, down once for training; a round's
    # evaluation travels with the next round's train messages and evaluates the prompt they carry
    # (nothing more is sent), except the last round's, which goes alone
    prompt = 16 * 96 * 4
    assert rounds[0]["train_bytes_up"] == N * prompt and rounds[0]["train_bytes_down"] == N * prompt
    assert rounds[0]["evaluate_bytes_up"] == rounds[0]["evaluate_bytes_down"] == 0
    assert rounds[0]["bytes"] == {
        "train_down": N * prompt,
        "train_up": N * prompt,
        "evaluate_down": 0,
        "evaluate_up": 0,
    }
    assert rounds[-1]["bytes"]["evaluate_down"] == N * prompt
    assert rounds[-1]["evaluate_bytes_down"] == N * prompt and rounds[-1]["train_bytes_down"] == N * prompt
    assert data["final"]["train_bytes_up"] == sum(r["bytes"]["train_up"] for r in rounds)
    assert {"local-acc-last10-mean", "neighbor-acc-last10-mean"} <= set(data["final"])
    assert data["run"]["status"] == "finished"
    for f in ("accuracy.png", "loss.png", "final_shared.pt", "checkpoint.pt"):
        assert (rec.dir / f).exists(), f
    # only the declared shared tensor ever left a client
    assert all(keys <= {"ctx"} for keys in _arrays_sent(grid, "up"))


def test_promptfl_aggregate_is_the_weighted_mean_of_replies(make_cfg, pretrained_clip):
    captured = []

    def spy(req, reply):
        if not reply.has_error() and len(reply.content["arrays"]):
            captured.append((reply.content["arrays"]["ctx"].numpy(), reply.content["metrics"]["num-examples"]))
        return reply

    rec, _ = _run(
        make_cfg,
        n=4,
        intercept=spy,
        method="promptfl",
        num_server_rounds=1,
        partitioner="quantity-skew",
        quantity_ratios="4:3:2:1",
    )
    import torch

    final = torch.load(rec.dir / "final_shared.pt", weights_only=True)["arrays"]["ctx"].numpy()
    weights = np.array([n for _, n in captured], dtype=float)
    assert len(set(weights)) > 1  # unequal data sizes
    expected = sum(w * c for (c, _), w in zip(captured, weights, strict=True)) / weights.sum()
    np.testing.assert_allclose(final, expected, rtol=1e-5, atol=1e-6)


def test_coop_keeps_its_prompt_private_and_across_rounds(make_cfg, pretrained_clip):
    rec, grid = _run(make_cfg, method="coop", num_server_rounds=3)
    rounds = rec.data["rounds"]
    assert all(r["train_bytes_up"] == r["evaluate_bytes_up"] == 0 for r in rounds)  # only metrics leave a client
    assert rounds[0]["train_bytes_down"] > 0 and rounds[1]["train_bytes_down"] == 0  # init prompt once
    for r, expected in zip(rounds, (1, 2, 3), strict=True):
        assert {c["train/rounds-trained"] for c in r["clients"].values()} == {expected}
    assert all(not keys for keys in _arrays_sent(grid, "up"))
    local = [r["metrics"]["local-acc"] for r in rounds]
    assert local[-1] > local[0]
    # personalised prompts: better on own classes than on the neighbours'
    assert rounds[-1]["metrics"]["local-acc"] > rounds[-1]["metrics"]["neighbor-acc"]


def test_zeroshot_is_one_evaluation_round(make_cfg, pretrained_clip):
    rec, grid = _run(make_cfg, method="zeroshot", num_server_rounds=5)
    assert len(rec.data["rounds"]) == 1
    assert all(m.metadata.message_type in ("query", "evaluate") for m in grid.sent)
    acc = rec.data["rounds"][0]["metrics"]["local-acc"]
    assert acc > 3 / 40  # the pretrained tiny CLIP knows the domain: far above chance (2.5%)


def test_bad_replies_are_dropped_and_the_round_goes_on(make_cfg, pretrained_clip):
    def corrupt(req, reply):
        if req.metadata.message_type != "train" or reply.has_error():
            return reply
        victim = sorted(grid_ref[0].contexts)[:2]
        if req.metadata.dst_node_id == victim[0]:
            bad = reply.content["arrays"]["ctx"].numpy().copy()
            bad[0, 0] = np.nan
            reply.content["arrays"] = ArrayRecord({"ctx": Array(bad)})
        elif req.metadata.dst_node_id == victim[1]:
            reply.content["arrays"] = ArrayRecord({"ctx": Array(np.zeros((3, 3), np.float32))})
        return reply

    grid_ref = []
    cfg = make_cfg(method="promptfl", num_server_rounds=2)
    grid = InProcessGrid(
        client_app, [{"partition-id": i, "num-partitions": 4} for i in range(4)], cfg.as_dict(), intercept=corrupt
    )
    grid_ref.append(grid)
    rec = execute(cfg, grid, run_id="test")
    for r in rec.data["rounds"]:
        reasons = sorted(d["reason"] for d in r["dropped"])
        assert len(reasons) == 2 and "NaN" in " ".join(reasons) and "shape" in " ".join(reasons)
        assert r["metrics"]["train-clients"] == 2
    import torch

    final = torch.load(rec.dir / "final_shared.pt", weights_only=True)["arrays"]["ctx"]
    assert torch.isfinite(final).all()


def test_send_guard_stops_a_leaking_client(make_cfg, pretrained_clip, monkeypatch):
    from fedvlm.client_app import prompt_clients

    def leaky_train(self, arrays, config):
        ctx = self._own_ctx(arrays)
        return TrainReply({"ctx": ctx}, {NUM_EXAMPLES: 1})

    monkeypatch.setattr(prompt_clients.CoOpClient, "train", leaky_train)
    rec, grid = _run(make_cfg, n=3, method="coop", num_server_rounds=1)
    dropped = [d for d in rec.data["rounds"][0]["dropped"] if d["phase"] == "train"]
    assert len(dropped) == 3 and all("refusing to send tensor 'ctx'" in d["reason"] for d in dropped)
    assert all(not keys for keys in _arrays_sent(grid, "up"))


def test_a_node_that_cannot_load_its_data_is_excluded(make_cfg, pretrained_clip, tmp_path):
    nodes = [{"partition-id": i, "num-partitions": 3} for i in range(3)] + [{"data-dir": str(tmp_path / "missing")}]
    rec, grid = _run(make_cfg, node_configs=nodes, method="promptfl", num_server_rounds=1)
    excluded = rec.data["run"]["excluded_nodes"]
    assert len(excluded) == 1 and "does not exist" in next(iter(excluded.values()))
    assert len(rec.data["rounds"][0]["clients"]) == 3


def test_too_few_healthy_nodes_stops_before_training(make_cfg, pretrained_clip, tmp_path):
    nodes = [{"data-dir": str(tmp_path / "missing")}, {"partition-id": 0, "num-partitions": 1}]
    with pytest.raises(FederationError, match="(?s)only 1 healthy node.*does not exist"):
        _run(make_cfg, node_configs=nodes, method="promptfl", num_server_rounds=1, round_timeout=1.0)


class _Naps:
    """Counts the registry's sleeps; the ``limit``-th ends the wait (a deployment would wait
    round-timeout)."""

    def __init__(self):
        self.count, self.limit = 0, None

    def __call__(self, seconds: float) -> None:
        self.count += 1
        if self.limit is not None and self.count >= self.limit:
            raise TimeoutError("still waiting for nodes")


@pytest.mark.parametrize("broken", [True, False])
def test_a_simulation_short_of_healthy_nodes_fails_once_every_node_answered(
    broken, make_cfg, pretrained_clip, tmp_path, monkeypatch
):
    """In simulation every node exists from the start: no waiting round-timeout (600 s by
    default) for nodes that cannot come; deployed, the same federation waits for them."""
    from fedvlm.strategies import nodes as registry

    naps = _Naps()
    monkeypatch.setattr(registry.time, "sleep", naps)
    configs = [{"partition-id": 0, "num-partitions": 1}] + ([{"data-dir": str(tmp_path / "missing")}] if broken else [])
    why = "(?s)only 1 healthy node.*does not exist" if broken else "the simulation has 1 node.*2 needed.*num-supernodes"
    with pytest.raises(FederationError, match=why):
        _run(make_cfg, node_configs=configs, simulation=True, method="promptfl", num_server_rounds=1, min_nodes=2)
    assert naps.count == 0
    naps.limit = 3
    with pytest.raises(TimeoutError, match="still waiting"):
        _run(make_cfg, node_configs=configs, method="promptfl", num_server_rounds=1, min_nodes=2, round_timeout=600)


def test_a_config_error_every_node_shares_stops_at_once(make_cfg, pretrained_clip, tmp_path):
    import time

    t0 = time.time()
    with pytest.raises(FederationError) as err:
        _run(make_cfg, n=3, dataset="image-folder", data_root=str(tmp_path / "nowhere"))
    assert time.time() - t0 < 60  # no waiting for the 600 s round timeout
    msg = str(err.value)
    assert "3 node(s)" in msg and "does not exist" in msg and "Traceback" not in msg


def test_same_seed_same_numbers(make_cfg, pretrained_clip):
    a, _ = _run(make_cfg, n=4, method="promptfl", num_server_rounds=2, fraction_train=0.5, run_name="a")
    b, _ = _run(make_cfg, n=4, method="promptfl", num_server_rounds=2, fraction_train=0.5, run_name="b")
    untimed = lambda m: {k: v for k, v in m.items() if "seconds" not in k}  # noqa: E731
    for ra, rb in zip(a.data["rounds"], b.data["rounds"], strict=True):
        assert untimed(ra["metrics"]) == untimed(rb["metrics"])
        trained = lambda r: sorted(n for n, c in r["clients"].items() if "train/num-examples" in c)  # noqa: E731
        assert trained(ra) == trained(rb) and len(trained(ra)) == 2


@pytest.mark.parametrize(
    "overrides",
    [
        {"dataset": "digits", "partitioner": "dirichlet", "dirichlet_alpha": 0.5},
        {"partitioner": "iid", "prompt__augment": True, "prompt__local_steps": 2},
        {"prompt__class_specific": True, "prompt__n_ctx": 4},
        {"prompt__ctx_init": "a photo of a", "prompt__optimizer": "sgd", "prompt__fedprox_mu": 0.1},
    ],
    ids=["digits-dirichlet", "iid-augment", "class-specific", "phrase-init-fedprox"],
)
def test_option_combinations_run(make_cfg, pretrained_clip, overrides):
    rec, grid = _run(make_cfg, n=3, method="promptfl", num_server_rounds=2, **overrides)
    rounds = rec.data["rounds"]
    assert len(rounds) == 2 and not any(r["dropped"] for r in rounds)
    assert all(np.isfinite(r["metrics"]["local-acc"]) for r in rounds)
    shapes = {
        tuple(m.content["arrays"]["ctx"].shape)
        for m in grid.replies
        if "arrays" in m.content and len(m.content["arrays"])
    }
    if overrides.get("prompt__class_specific"):
        assert shapes == {(40, 4, 96)}
    elif "prompt__ctx_init" in overrides:
        assert shapes == {(4, 96)}  # the phrase's four tokens set M
    if overrides.get("dataset") == "digits":
        assert rec.data["run"]["nodes"][0]["num_classes"] == 10


def _trained_round_1(req, node) -> bool:
    """``req`` is ``node``'s train message of round 1 (its reply is on its way)."""
    return (
        req.metadata.message_type == "train"
        and int(req.content["config"][SERVER_ROUND]) == 1
        and req.metadata.dst_node_id == node
    )


def _go_offline_after_round_1(grid_ref, victims):
    """Each victim goes offline once it has answered its train message of round 1."""

    def intercept(req, reply):
        if any(_trained_round_1(req, v) for v in victims):
            grid_ref[0].offline.add(req.metadata.dst_node_id)
        return reply

    return intercept


def test_a_node_lost_mid_run_leaves_the_rounds_to_the_others(make_cfg, pretrained_clip):
    grid_ref = []
    cfg = make_cfg(method="promptfl", num_server_rounds=3)
    grid = InProcessGrid(
        client_app,
        [{"partition-id": i, "num-partitions": 3} for i in range(3)],
        cfg.as_dict(),
        intercept=_go_offline_after_round_1(grid_ref, [1002]),
    )
    grid_ref.append(grid)
    rec = execute(cfg, grid, run_id="test")
    assert rec.data["run"]["status"] == "finished"
    assert [r["metrics"]["train-clients"] for r in rec.data["rounds"]] == [3, 2, 2]
    assert all("client-2" not in r["clients"] for r in rec.data["rounds"][1:])


def test_a_node_restarted_under_a_new_id_rejoins_with_its_state(make_cfg, pretrained_clip):
    """A SuperNode restarted without authentication comes back under a new node id and with
    nothing in memory: the server takes it for the same node (same name), and the node restores
    its private state from disk (the simulated run folder's nodes/)."""
    from flwr.app import Context, RecordDict

    def restart_after_round_1(req, reply):
        grid = grid_ref[0]
        if _trained_round_1(req, 1002):
            if 1002 not in grid.offline:
                old = grid.contexts[1002]
                grid.offline.add(1002)
                grid.contexts[2002] = Context(2, 2002, dict(old.node_config), RecordDict(), dict(old.run_config))
        return reply

    grid_ref = []
    cfg = make_cfg(method="coop", num_server_rounds=3)
    grid = InProcessGrid(
        client_app,
        [{"partition-id": i, "num-partitions": 3} for i in range(3)],
        cfg.as_dict(),
        intercept=restart_after_round_1,
    )
    grid_ref.append(grid)
    rec = execute(cfg, grid, run_id="test")
    assert rec.data["run"]["status"] == "finished" and not rec.data["run"]["excluded_nodes"]
    assert [r["metrics"]["train-clients"] for r in rec.data["rounds"]] == [3, 3, 3]
    # the restarted node counted on from the state it had written in round 1
    assert [r["clients"]["client-2"]["train/rounds-trained"] for r in rec.data["rounds"]] == [1, 2, 3]


def _lose_handshakes(node: int, times: int):
    lost = []

    def intercept(req, reply):
        if req.metadata.message_type == "query" and req.metadata.dst_node_id == node and len(lost) < times:
            lost.append(req)
            return None
        return reply

    return intercept


def test_a_lost_handshake_reply_is_asked_again(make_cfg, pretrained_clip):
    rec, grid = _run(
        make_cfg, n=3, intercept=_lose_handshakes(1001, 1), method="promptfl", num_server_rounds=1, round_timeout=1.0
    )
    assert sum(m.metadata.message_type == "query" and m.metadata.dst_node_id == 1001 for m in grid.sent) == 2
    assert rec.data["run"]["excluded_nodes"] == {}
    assert sorted(rec.data["rounds"][0]["clients"]) == ["client-0", "client-1", "client-2"]


def test_a_node_that_never_answers_the_handshake_is_excluded(make_cfg, pretrained_clip):
    rec, _ = _run(
        make_cfg, n=3, intercept=_lose_handshakes(1001, 99), method="promptfl", num_server_rounds=1, min_nodes=2
    )
    assert rec.data["run"]["excluded_nodes"] == {"1001": "no reply to 2 handshakes, each within round-timeout"}
    assert sorted(rec.data["rounds"][0]["clients"]) == ["client-0", "client-2"]


def test_fewer_nodes_than_min_nodes_mid_run_fails_with_the_reason(make_cfg, pretrained_clip):
    grid_ref = []
    cfg = make_cfg(method="promptfl", num_server_rounds=3, min_nodes=2, round_timeout=2.0)
    grid = InProcessGrid(
        client_app,
        [{"partition-id": i, "num-partitions": 2} for i in range(2)],
        cfg.as_dict(),
        intercept=_go_offline_after_round_1(grid_ref, [1001]),
    )
    grid_ref.append(grid)
    with pytest.raises(
        FederationError,
        match=r"round 2: only 1 healthy node.*min-nodes = 2 after waiting round-timeout = 2 s "
        r"\(disconnected: client-1\)",
    ):
        execute(cfg, grid, run_id="test")


class _BrieflyOffline(InProcessGrid):
    """A node missing from the connected nodes for a few polls after round 1, as a SuperNode
    whose heartbeat came late is marked offline by the SuperLink for a moment."""

    def __init__(self, *args, node: int, polls: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.node, self.polls = node, polls

    def get_node_ids(self):
        if self.node in self.offline:
            self.polls -= 1
            if self.polls < 0:
                self.offline.discard(self.node)
        return super().get_node_ids()


def test_a_node_briefly_offline_is_waited_for_before_min_nodes_fails(make_cfg, pretrained_clip):
    grid_ref = []
    cfg = make_cfg(method="promptfl", num_server_rounds=2, min_nodes=3)
    grid = _BrieflyOffline(
        client_app,
        [{"partition-id": i, "num-partitions": 3} for i in range(3)],
        cfg.as_dict(),
        intercept=_go_offline_after_round_1(grid_ref, [1002]),
        node=1002,
        polls=3,
    )
    grid_ref.append(grid)
    rec = execute(cfg, grid, run_id="test")
    assert rec.data["run"]["status"] == "finished"
    assert [r["metrics"]["train-clients"] for r in rec.data["rounds"]] == [3, 3]


def test_own_data_nodes_train_on_exactly_their_folders(make_cfg, pretrained_clip, tmp_path):
    from fedvlm.data.registry import load_image_folder
    from fedvlm.deploy.export_folder import export_partitions

    folders = export_partitions(tmp_path / "orgs", 2)
    nodes = [{"data-dir": str(f)} for f in folders]
    rec, _ = _run(make_cfg, node_configs=nodes, method="promptfl", num_server_rounds=1)
    joined = {n["name"]: n for n in rec.data["run"]["nodes"]}
    for f in folders:
        split = load_image_folder(f, 0.3)
        assert joined[f.name]["num_train"] == len(split.train) and joined[f.name]["num_test"] == len(split.test)
        assert joined[f.name]["partition_id"] == -1 and joined[f.name]["num_classes"] == 40
    assert set(rec.data["rounds"][0]["clients"]) == {f.name for f in folders}


def test_a_node_with_another_class_list_is_excluded(make_cfg, pretrained_clip, tmp_path):
    from fedvlm.deploy.export_folder import export_partitions

    folders = export_partitions(tmp_path / "orgs", 3)
    listing = folders[2] / "classes.txt"
    names = listing.read_text().split("\n")
    listing.write_text("\n".join([names[1], names[0], *names[2:]]))  # same classes, two labels swapped
    rec, _ = _run(
        make_cfg, node_configs=[{"data-dir": str(f)} for f in folders], method="promptfl", num_server_rounds=1
    )
    excluded = rec.data["run"]["excluded_nodes"]
    assert len(excluded) == 1 and "class list differs" in next(iter(excluded.values()))
    assert set(rec.data["rounds"][0]["clients"]) == {"client-0", "client-1"}


def test_own_data_nodes_draw_secret_noise_and_the_ledger_says_so(make_cfg, pretrained_clip, tmp_path):
    from fedvlm.deploy.export_folder import export_partitions

    folders = export_partitions(tmp_path / "orgs", 2, {"max-per-class": 4})
    own = [{"data-dir": str(f)} for f in folders]
    dp = dict(method="dpfpl", num_server_rounds=1, max_per_class=4, privacy__epsilon=1.0, prompt__local_steps=2)
    runs = [_run(make_cfg, node_configs=own, run_name=f"own{i}", **dp)[0] for i in range(2)]
    sources = runs[0].data["privacy"]["noise_sources"]
    assert sources == {"server": "os", "clients": {"client-0": "os", "client-1": "os"}}
    assert not any("seeded noise" in n for n in runs[0].data["privacy"]["notes"])
    # same config and seed, different noise: nobody can regenerate it from the run config
    assert runs[0].data["rounds"][0]["metrics"]["train-loss"] != runs[1].data["rounds"][0]["metrics"]["train-loss"]

    sim = [{"partition-id": i, "num-partitions": 2} for i in range(2)]
    runs = [_run(make_cfg, node_configs=sim, run_name=f"sim{i}", **dp)[0] for i in range(2)]
    assert runs[0].data["privacy"]["noise_sources"] == {
        "server": "seeded",
        "clients": {"client-0": "seeded", "client-1": "seeded"},
    }
    assert any("seeded noise" in n for n in runs[0].data["privacy"]["notes"])
    untimed = [{k: v for k, v in r.data["rounds"][0]["metrics"].items() if "seconds" not in k} for r in runs]
    assert untimed[0] == untimed[1]  # seeded: the same run twice gives the same numbers


@pytest.mark.parametrize("count", ["local-n", "num-examples"])
def test_an_evaluation_cannot_claim_more_records_than_the_nodes_handshake(count, make_cfg, pretrained_clip):
    """One node claiming 10^15 test records once set the federation's weighted accuracy to its own:
    a weight past the handshake's count is left out (num-examples: the reply is rejected)."""
    from flwr.app import MetricRecord

    from fedvlm.protocol import EVALUATION

    def inflate(req, reply):
        if reply.has_error() or req.metadata.dst_node_id != liar[0]:
            return reply
        key = EVALUATION if EVALUATION in reply.content else "metrics"
        if req.metadata.message_type == "evaluate" or key == EVALUATION:
            reply.content[key] = MetricRecord({**dict(reply.content[key]), count: 10**15})
        return reply

    liar: list[int] = []
    cfg = make_cfg(method="promptfl", num_server_rounds=2)
    grid = InProcessGrid(
        client_app, [{"partition-id": i, "num-partitions": 4} for i in range(4)], cfg.as_dict(), intercept=inflate
    )
    liar.append(min(grid.contexts))
    rounds = execute(cfg, grid, run_id="test").data["rounds"]
    evaluated = [r for r in rounds if "local-acc" in r["metrics"]]
    assert evaluated
    for r in evaluated:
        if count == "num-examples":
            assert [d["phase"] for d in r["dropped"]] == ["evaluate"]
            assert "more than the" in r["dropped"][0]["reason"]
        else:
            (refused,) = r["refused_metrics"]
            assert refused["metrics"] == ["local-n"] and "handshake" in refused["reason"]
        # the weighted accuracy is the honest nodes' alone (the liar's weight left out with its claim)
        rows = [row for row in r["clients"].values() if row.get("eval/local-n", 10**15) < 10**15]
        total = sum(row["eval/local-n"] for row in rows)
        want = sum(row["eval/local-acc"] * row["eval/local-n"] for row in rows) / total
        assert len(rows) == 3 and r["metrics"]["local-acc-weighted"] == pytest.approx(want)


def test_a_node_config_typo_excludes_the_node_with_its_fix(make_cfg, pretrained_clip, tmp_path):
    """'stat-dir' once kept a deployed node's private state in memory only, without a word."""
    configs = [{"partition-id": i, "num-partitions": 3} for i in range(3)]
    configs[2]["stat-dir"] = str(tmp_path / "state")
    rec, _ = _run(make_cfg, node_configs=configs, method="promptfl", num_server_rounds=1, min_nodes=2)
    (why,) = rec.data["run"]["excluded_nodes"].values()
    assert "'stat-dir' is not a key this node knows: did you mean 'state-dir'" in why
    assert rec.data["run"]["status"] == "finished" and len(rec.data["run"]["nodes"]) == 2


def test_a_deployment_short_of_nodes_stops_after_round_timeout_with_the_reason(make_cfg, pretrained_clip):
    """min-nodes above the federation's size waited forever in deployment, whatever round-timeout said."""
    with pytest.raises(FederationError, match=r"1 SuperNode\(s\) connected within round-timeout \(2 s\), 2 needed"):
        _run(make_cfg, n=1, method="promptfl", num_server_rounds=1, min_nodes=2, round_timeout=2.0)


def test_base_to_novel_scores_every_node_on_classes_no_node_trained_on(make_cfg, pretrained_clip):
    """CoCoOp's protocol: the nodes train and test locally on the base half of the classes and are
    also scored on their share of the novel half's test records, which the handshake declares
    (the server bounds the evaluation's counts by it); the round's figures carry the novel
    accuracy, its spread over the nodes (mean, worst, std) and CoCoOp's harmonic mean H of the
    base (own classes) and novel means."""
    from fedvlm.client_app.node import _dataset
    from fedvlm.metrics import ACC, ACC_STD, ACC_WORST, BASE_NOVEL_HM, NOVEL_N

    rec, grid = _run(make_cfg, n=4, method="promptfl", num_server_rounds=2, class_split="base-to-novel")
    data = json.loads(rec.path.read_text())
    splits = _dataset(make_cfg(method="promptfl"))
    base = (splits.n_classes + 1) // 2
    nodes = {node["name"]: node for node in data["run"]["nodes"]}
    assert all(max(int(c) for c in node["info"]["classes"].split(",")) < base for node in nodes.values())
    for r in data["rounds"]:
        rows = [row for row in r["clients"].values() if f"eval/{NOVEL_N}" in row]
        assert len(rows) == 4 and all(row[f"eval/{NOVEL_N}"] > 0 for row in rows)
        # every novel test record scored once, by one node
        assert sum(row[f"eval/{NOVEL_N}"] for row in rows) == int((splits.test.labels >= base).sum())
        accs = [row["eval/" + ACC["novel"]] for row in rows]
        assert r["metrics"][ACC["novel"]] == pytest.approx(np.mean(accs))
        assert r["metrics"][ACC_WORST["novel"]] == pytest.approx(min(accs))
        assert r["metrics"][ACC_STD["novel"]] == pytest.approx(np.std(accs))
        base_acc, novel_acc = r["metrics"][ACC["local"]], r["metrics"][ACC["novel"]]
        assert r["metrics"][BASE_NOVEL_HM] == pytest.approx(2 * base_acc * novel_acc / (base_acc + novel_acc))
    assert f"{ACC['novel']}-last10-mean" in data["final"] and f"{BASE_NOVEL_HM}-last10-mean" in data["final"]
