"""The LoRA family end to end in one process (real ServerApp strategy, real ClientApp, real
Flower messages, the embedded tiny VLM): what travels, what stays, what is learned."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from fedvlm.client_app.app import app as client_app
from fedvlm.client_app.state import PRIVATE
from fedvlm.metrics import FEDRAND_CLIENTS
from fedvlm.models.adapter_parts import lora_half
from fedvlm.protocol import LOCAL_SIGMA, REPLY_KEYS, SERVER_ROUND, TrainInstruction
from fedvlm.server_app.app import execute
from fedvlm.spec import spec_of
from fedvlm.strategies.parts import RunParts
from fedvlm.utils.inprocess import InProcessGrid

N_CLIENTS = 4


def _raw(cache_dir, tmp_path, method: str, **extra) -> dict:
    raw = {
        "method": method,
        "num-server-rounds": 3,
        "fraction-train": 0.5,
        "lora.local-steps": 3,
        "vlm.eval-samples": 4,
        "vlm.max-new-tokens": 16,
        "cache-dir": str(cache_dir),
        "output-dir": str(tmp_path / "runs"),
        "run-name": method,
    }
    raw.update(extra)
    return raw


def _run(raw: dict):
    from fedvlm.methods.validation import validate

    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": N_CLIENTS} for i in range(N_CLIENTS)], raw)
    recorder = execute(validate(raw), grid, raw["method"])
    return grid, recorder


def _arrays(msg) -> dict[str, np.ndarray]:
    if msg.has_error() or "arrays" not in msg.content:
        return {}
    return {k: np.asarray(v.numpy()) for k, v in msg.content["arrays"].items()}


@pytest.fixture(scope="module")
def fedrand_run(vlm_cache, tmp_path_factory):
    raw = _raw(vlm_cache, tmp_path_factory.mktemp("fedrand"), "fedrand", **{"attack.observe-uploads": True})
    return _run(raw)


def test_fedrand_sends_each_client_exactly_its_drawn_half(fedrand_run):
    grid, recorder = fedrand_run
    data = recorder.data
    assert data["run"]["status"] == "finished" and len(data["rounds"]) == 3
    seen: set[str] = set()
    assert len(grid.sent) == len(grid.replies)  # no node went offline: replies pair with requests
    pairs = [(m, r) for m, r in zip(grid.sent, grid.replies, strict=True) if m.metadata.message_type == "train"]
    assert pairs
    for msg, reply in pairs:
        rnd = int(msg.content["config"][SERVER_ROUND])
        name = f"client-{grid.contexts[msg.metadata.dst_node_id].node_config['partition-id']}"
        half = data["rounds"][rnd - 1]["clients"][name]["fedrand/half"]
        down = set(_arrays(msg))
        everything = set(lora_half(down, "A")) | set(lora_half(down, "B"))
        if name not in seen:  # first participation: both halves
            assert lora_half(down, "A") and lora_half(down, "B") and down == everything
        else:
            assert down == set(lora_half(down, half)) and lora_half(down, half)
        seen.add(name)
        up = set(_arrays(reply))
        assert up and up == set(lora_half(up, half)), (name, rnd, half)
        assert msg.content["config"][REPLY_KEYS] == ",".join(sorted(up))


def test_fedrand_private_counterpart_never_leaves_the_client(fedrand_run):
    grid, _ = fedrand_run
    uploaded = [v for r in grid.replies for v in _arrays(r).values()]
    checked = 0
    for ctx in grid.contexts.values():
        if PRIVATE not in ctx.state:
            continue
        own = {k: v.numpy() for k, v in ctx.state[PRIVATE].to_torch_state_dict().items()}
        sent = set(str(ctx.state["meta"]["sent"]).split(","))
        assert set(lora_half(own, "A")) and set(lora_half(own, "B"))  # it keeps both trained halves
        for name, value in own.items():
            if name in sent:
                continue
            checked += 1
            assert not any(u.shape == value.shape and np.array_equal(u, value) for u in uploaded), name
    assert checked > 0


def test_fedavg_lora_sends_the_whole_adapter_both_ways(vlm_cache, tmp_path):
    """FedRand's oracle baseline: every tensor up and down every round, nothing kept on the node."""
    grid, recorder = _run(_raw(vlm_cache, tmp_path, "fedavg-lora", **{"num-server-rounds": 1}))
    comm = recorder.data["communication"]
    assert comm["up_vs_full_lora"] == pytest.approx(1.0) and comm["down_vs_full_lora"] == pytest.approx(1.0)
    assert all(
        PRIVATE not in ctx.state or not ctx.state[PRIVATE].to_torch_state_dict() for ctx in grid.contexts.values()
    )


def test_fedrand_traffic_is_about_half_of_full_lora(fedrand_run):
    _, recorder = fedrand_run
    comm = recorder.data["communication"]
    shared = torch.load(recorder.dir / "final_shared.pt", weights_only=True)["arrays"]
    half_bytes = {h: sum(shared[k].numel() * shared[k].element_size() for k in lora_half(shared, h)) for h in "AB"}
    assert sum(half_bytes.values()) == comm["adapter_bytes"]
    # A is r x in and B is out x r: the halves are close in size, not equal
    assert 0.4 < half_bytes["A"] / comm["adapter_bytes"] < 0.6
    assert 0.4 < comm["up_vs_full_lora"] < 0.6
    assert comm["up_vs_full_lora"] < comm["down_vs_full_lora"] < 1.0  # first participations get both halves
    for r in recorder.data["rounds"]:
        for client in r["clients"].values():
            if "train/bytes_up" in client:
                assert client["train/bytes_up"] == half_bytes[client["fedrand/half"]]
                expect_down = comm["adapter_bytes"] if client["fedrand/first"] else half_bytes[client["fedrand/half"]]
                assert client["train/bytes_down"] == expect_down
    assert (recorder.dir / "reconstructed").is_dir() and list((recorder.dir / "reconstructed").glob("*.pt"))


def test_fedrand_loss_falls_and_caption_metrics_are_written(fedrand_run):
    _, recorder = fedrand_run
    rounds = recorder.data["rounds"]
    first = [c["train/train-loss-first"] for c in rounds[0]["clients"].values() if "train/train-loss-first" in c]
    last = [c["train/train-loss-last"] for c in rounds[-1]["clients"].values() if "train/train-loss-last" in c]
    assert np.mean(last) < np.mean(first)
    m = rounds[-1]["metrics"]
    for key in (
        "server-cider",
        "client-cider",
        "server-bleu-4",
        "server-rouge-l",
        "server-loss",
        "client-loss",
        "server-ood-cider",
        "server-ood-bleu-4",
    ):
        assert key in m and np.isfinite(m[key])
    assert rounds[-1]["metrics"]["server-loss"] < rounds[0]["metrics"]["server-loss"]
    # the run names the base weights it started from (a sweep's `backbone` column): those every node loaded
    run = recorder.data["run"]
    assert {n["backbone"] for n in run["nodes"]} == {run["backbone"]["fingerprint"]}
    # each node's own model: the worst node's CIDEr and the spread over the nodes beside the weighted mean
    own = [c["eval/client-cider"] for c in rounds[-1]["clients"].values() if "eval/client-cider" in c]
    assert m["client-cider-worst"] == pytest.approx(min(own)) and m["client-cider-std"] == pytest.approx(np.std(own))


def test_fedrand_draws_are_seeded(vlm_cache, tmp_path):
    from fedvlm.methods.registry import get_method
    from fedvlm.methods.validation import validate
    from fedvlm.strategies.nodes import NodeInfo

    nodes = [NodeInfo(i, f"client-{i}", i, 10, 5, 0, "x", 4) for i in range(8)]

    def draws(seed):
        cfg = validate({"method": "fedrand", "seed": seed, "cache-dir": str(vlm_cache)})
        s = get_method("fedrand").strategy(RunParts.of(cfg))
        return [s.draw(n, r) for r in range(1, 6) for n in nodes]

    a, b, c = draws(0), draws(0), draws(1)
    assert a == b and a != c
    assert 0.2 < np.mean([d == "A" for d in a]) < 0.8


def test_lora_state_survives_between_rounds_in_the_node_state(vlm_cache):
    from fedvlm.client_app.lora_clients import FedRandClient
    from fedvlm.client_app.vlm_node import vlm_node_data
    from fedvlm.methods.validation import validate

    cfg = validate({"method": "fedrand", "cache-dir": str(vlm_cache), "lora.local-steps": 2})
    node = vlm_node_data(cfg, {"partition-id": 0, "num-partitions": 4})
    state = RecordDict()
    first = FedRandClient(cfg, node, state, 1)
    a_names = lora_half(first.initial, "A")
    plan = TrainInstruction(1, tuple(a_names), local_steps=2, batch_size=8, num_train=len(node.train))
    reply = first.train(dict(first.initial), plan).arrays
    assert set(reply) == set(a_names)
    second = FedRandClient(cfg, node, state, 2)  # a new round: a new client object, the same node state
    b_from_server = {k: torch.zeros_like(v) for k, v in second.initial.items() if ".lora_B." in k}
    start = second.starting_adapter(b_from_server)
    for k in a_names:  # the A half comes from the node's own trained values
        assert torch.equal(start[k], second.own[k]) and torch.equal(start[k], reply[k])
        assert not torch.equal(start[k], first.initial[k])
    for k in b_from_server:  # the B half is what the server sent
        assert torch.equal(start[k], b_from_server[k])
    assert set(second.private) == set(b_from_server)  # the unsent B half is the private counterpart


@pytest.mark.parametrize("method", ["fedper-lora", "fedpara-lora"])
def test_private_parts_of_fedper_and_fedpara_never_travel(vlm_cache, tmp_path, method):
    grid, recorder = _run(_raw(vlm_cache, tmp_path, method, **{"num-server-rounds": 2}))
    assert recorder.data["run"]["status"] == "finished"
    names_down = {k for m in grid.sent for k in _arrays(m)}
    names_up = {k for r in grid.replies for k in _arrays(r)}
    private_names = set()
    for ctx in grid.contexts.values():
        if PRIVATE in ctx.state:
            private_names |= set(ctx.state[PRIVATE].to_torch_state_dict())
    assert names_down and names_up <= names_down
    kept = private_names - names_down
    assert kept, "the method should keep some adapter tensors on the clients"
    if method == "fedpara-lora":
        assert all(".hada_w1_" in k for k in names_down) and all(".hada_w2_" in k for k in kept)
    else:
        layers = {int(k.split(".layers.")[1].split(".")[0]) for k in names_down}
        assert layers == {max(layers) - 1, max(layers)}  # the top two layers


def test_no_attack_is_scored_on_a_fedpara_model_the_server_cannot_rebuild(vlm_cache, tmp_path):
    """FedPara's server holds the w1 pair only: every model it can rebuild keeps the clients' w2
    pair at its initial zero, so it is the base model, and an attack on it would score the base
    model. The report says so, and a board's row carries that reason instead of chance figures."""
    import json

    from fedvlm.attacks import NoAttackApplies
    from fedvlm.attacks.maxrenyi import pooled_attacks
    from fedvlm.experiments.sweep import attack_columns
    from fedvlm.methods.registry import get_method
    from fedvlm.methods.validation import validate
    from fedvlm.models.vlm import load_vlm
    from fedvlm.utils.files import load_saved

    _, recorder = _run(_raw(vlm_cache, tmp_path, "fedpara-lora", **{"num-server-rounds": 2}))
    cfg = validate(recorder.data["config"])
    _, initial, _ = load_vlm(cfg, spec_of(cfg).adapter)
    w2_b = {k: v for k, v in initial.items() if ".hada_w2_b" in k}
    assert w2_b and all(not torch.as_tensor(v).any() for v in w2_b.values())  # the product's zero factor
    rebuilt = dict(load_saved(recorder.dir / "final_shared.pt", "test")["arrays"])
    for path in (recorder.dir / "reconstructed").glob("*.pt"):
        rebuilt.update(load_saved(path, "test")["arrays"])
    assert rebuilt and not any(".hada_w2_" in k for k in rebuilt)  # so every rebuilt w2_b stays zero

    with pytest.raises(NoAttackApplies, match="base model"):
        pooled_attacks(recorder.dir)
    threats = json.loads((recorder.dir / "maxrenyi.json").read_text())["threats"]
    assert set(threats) == {"server", "client"} and all("base model" in t["skipped"] for t in threats.values())
    row = attack_columns(recorder.dir, get_method("fedpara-lora").family, shadows=0, online=0)
    assert set(row) == {"mia-error"} and "w2 pair" in row["mia-error"]


def test_maxrenyi_runs_on_a_fedrand_run_folder(fedrand_run):
    import json

    from fedvlm.attacks.maxrenyi import HEADLINE, run_maxrenyi
    from fedvlm.experiments.attack_report import attack_row
    from fedvlm.experiments.lora_compare import summarise
    from fedvlm.methods.registry import get_method

    _, recorder = fedrand_run
    report = run_maxrenyi(recorder.dir, samples=8, clients=2)
    assert json.loads((recorder.dir / "maxrenyi.json").read_text())["method"] == "fedrand"
    server = report["threats"]["server"]
    assert set(server) == {f"alpha={a},K={k}" for a in ("0.5", "1", "2", "inf") for k in (0, 10)}
    assert all(0.0 <= r["auroc"] <= 1.0 and r["n_members"] == 8 for r in server.values())
    clients = report["threats"]["client"]["per_client"]
    assert clients and all(c["uploaded"] for c in clients.values())  # rebuilt from what each client sent
    # intervals on every result; the clients also pooled into one ROC
    pooled = report["threats"]["client"]["pooled"][HEADLINE]
    for result in (pooled, server[HEADLINE]["intervals"], *(c[HEADLINE]["intervals"] for c in clients.values())):
        for metric in ("auc", "tpr@1%fpr", "tpr@0.1%fpr"):
            low, high = result[metric]["ci95"]
            assert 0.0 <= low <= result[metric]["value"] <= high <= 1.0
    # the comparison tool's row carries the fixed setting's intervals for its table and plot
    row = summarise("fedrand", json.loads((recorder.dir / "results.json").read_text()), report)
    assert row["mia-clients-maxrenyi10-auc"] == pooled["auc"]["value"]
    assert {"mia-server-maxrenyi10-tpr@1%fpr-lo", "mia-clients-maxrenyi10-tpr@0.1%fpr-hi"} <= set(row)
    # the run kept every upload: the server's attacks on them, per client and pooled
    uploads = report["threats"]["uploads"]
    assert set(uploads["summary"]) == {"server-alignment", "server-decomposition"} and uploads["per_client"]
    assert row["mia-uploads-decomposition-auc"] == uploads["summary"]["server-decomposition"]["pooled"]["auc"]["value"]
    # the family's attack hook (the sweep's --mia and the leaderboard) reads the same report, without running again
    spec = get_method("fedrand").family
    before = (recorder.dir / "maxrenyi.json").stat().st_mtime_ns
    by_attack = spec.attack(recorder.dir, 2, 0)
    assert (recorder.dir / "maxrenyi.json").stat().st_mtime_ns == before
    assert by_attack["clients-maxrenyi10"] == pooled and by_attack["server-maxrenyi10"] == server[HEADLINE]["intervals"]
    assert attack_row(by_attack) == {
        k: v for k, v in row.items() if k.startswith("mia-") and "auroc" not in k and "setting" not in k
    }


def test_the_server_rebuilds_a_fedrand_client_from_its_earlier_uploads():
    """FedRand's round: the server sent half A; the client's B is its last upload of B, never the
    server's; the descent is the uploaded A's change from the A sent."""
    from fedvlm.client_app.lora_clients import FedRandClient

    a1, a2, a3, b1 = (torch.full((2, 3), float(v)) for v in (1, 2, 5, 7))
    view = FedRandClient.server_view(
        {"x.lora_A.weight": a2}, {"x.lora_A.weight": a3}, {"x.lora_A.weight": a1, "x.lora_B.weight": b1}
    )
    assert torch.equal(view.model["x.lora_A.weight"], a2) and torch.equal(view.model["x.lora_B.weight"], b1)
    assert set(view.descent) == {"x.lora_A.weight"} and torch.equal(view.descent["x.lora_A.weight"], a3 - a2)


def test_fedrand_with_dp_sgd_spends_what_the_ledger_says(vlm_cache, tmp_path):
    grid, recorder = _run(
        _raw(
            vlm_cache,
            tmp_path,
            "fedrand",
            **{
                "num-server-rounds": 2,
                "privacy.epsilon": 2.0,
                "privacy.clip": 1.0,
                "lora.local-steps": 2,
                "lora.batch-size": 4,
            },
        )
    )
    data = recorder.data
    assert data["run"]["status"] == "finished" and not any(r["dropped"] for r in data["rounds"])
    ledger = data["privacy"]
    plans = ledger["client_mechanisms"]
    assert len(plans) == N_CLIENTS and all("ldp-adapter" in p for p in plans.values())
    for per in plans.values():
        plan = per["ldp-adapter"]
        assert plan["party"] == "client" and plan["planned_epsilon"] <= 2.0 * (1 + 1e-6)
        assert plan["releases"] == 2 * 2  # rounds x local steps
    spent = ledger["rounds"][-1]
    assert 0 < spent["epsilon"] <= 2.0 * (1 + 1e-6)
    trained = [c for r in data["rounds"] for c in r["clients"].values() if "train/dp-clipped-fraction" in c]
    assert trained and all(0.0 <= c["train/dp-clipped-fraction"] <= 1.0 for c in trained)
    # the noise each client drew with is the ledger's sigma
    sent = [m for m in grid.sent if m.metadata.message_type == "train"]
    for m in sent:
        name = f"client-{grid.contexts[m.metadata.dst_node_id].node_config['partition-id']}"
        assert m.content["config"][LOCAL_SIGMA] == pytest.approx(plans[name]["ldp-adapter"]["sigma"])


def test_fedrand_clients_refuse_requests_that_break_the_half_rule(vlm_cache, tmp_path, monkeypatch):
    """A server that asks for both halves, or sends both after a first participation, could
    rebuild a client's whole adapter: the client refuses (checked on the node, not trusted)."""
    from fedvlm.strategies.lora import FedRandStrategy

    drawn = FedRandStrategy.train_payload

    def ask_both(self, node, rnd, arrays):
        payload = drawn(self, node, rnd, arrays)
        payload.expected = {k: arrays[k].shape for k in self.shared_names}
        return payload

    monkeypatch.setattr(FedRandStrategy, "train_payload", ask_both)
    grid, rec = _run(
        _raw(
            vlm_cache,
            tmp_path / "both-up",
            "fedrand",
            **{"num-server-rounds": 1, "fraction-train": 1.0, "lora.local-steps": 1},
        )
    )
    dropped = rec.data["rounds"][0]["dropped"]
    assert len(dropped) == N_CLIENTS and all("not one whole LoRA half" in d["reason"] for d in dropped), dropped

    monkeypatch.undo()

    def both_halves(self, node, rnd, arrays):
        payload = drawn(self, node, rnd, arrays)
        payload.arrays = dict(arrays)
        return payload

    monkeypatch.setattr(FedRandStrategy, "train_payload", both_halves)
    grid, rec = _run(
        _raw(
            vlm_cache,
            tmp_path / "both-down",
            "fedrand",
            **{"num-server-rounds": 2, "fraction-train": 1.0, "lora.local-steps": 1},
        )
    )
    first, second = rec.data["rounds"]
    # a first participation starts from the whole adapter; round 1's evaluation, which rode in
    # the refused round-2 messages, still came back (the node reports the failed part alone)
    assert not first["dropped"] and first["metrics"]["eval-clients"] == N_CLIENTS
    assert len(second["dropped"]) == N_CLIENTS
    assert all("must send exactly that half" in d["reason"] for d in second["dropped"])


def test_fedrand_nodes_train_on_their_own_folders_with_partition_nodes(vlm_cache, tmp_path):
    """An organisation with its own captioned images joins FedRand (data-dir: images + data.jsonl),
    beside nodes on partitions of the run's dataset; with privacy on its noise is its own."""
    from fedvlm.deploy.export_folder import export_partitions
    from fedvlm.methods.validation import validate

    own = export_partitions(tmp_path / "orgs", 2, {"method": "fedrand", "seed": 7})
    raw = _raw(
        vlm_cache, tmp_path, "fedrand", **{"privacy.epsilon": 8.0, "fraction-train": 1.0, "num-server-rounds": 2}
    )
    nodes = [{"data-dir": str(f), "name": f"org-{i}"} for i, f in enumerate(own)] + [
        {"partition-id": 0, "num-partitions": 2}
    ]
    grid = InProcessGrid(client_app, nodes, raw)
    data = execute(validate(raw), grid, "own").data
    assert data["run"]["status"] == "finished", data["run"]
    info = {n["name"]: n for n in data["run"]["nodes"]}
    assert {k: info[k]["partition_id"] for k in ("org-0", "org-1")} == {"org-0": -1, "org-1": -1}
    assert data["privacy"]["noise_sources"]["clients"] == {"org-0": "os", "org-1": "os", "client-0": "seeded"}
    assert all(r["metrics"]["train-clients"] == 3 and not r["dropped"] for r in data["rounds"])


def test_a_run_stopped_by_its_budget_counts_only_the_train_messages_it_sent(vlm_cache, tmp_path):
    """The round the budget stops is planned and never sent: it must leave no trace in the
    communication summary (it used to be counted as sent, understating down_vs_full_lora)."""
    raw = _raw(
        vlm_cache,
        tmp_path,
        "fedavg-lora",
        **{
            "num-server-rounds": 10,
            "fraction-train": 1.0,
            "lora.local-steps": 1,
            "privacy.noise-multiplier": 1.0,
            "privacy.max-epsilon": 1.6,  # round 4 would take each record to 1.63
        },
    )
    grid, recorder = _run(raw)
    data = recorder.data
    assert data["run"]["status"] == "stopped" and len(data["rounds"]) == 3
    sent = sum(m.metadata.message_type == "train" for m in grid.sent)
    assert sent == N_CLIENTS * len(data["rounds"])
    comm = data["communication"]
    assert comm["full_lora_bytes_down"] == comm["adapter_bytes"] * sent
    assert comm["down_vs_full_lora"] == pytest.approx(comm["train_bytes_down"] / (comm["adapter_bytes"] * sent))


def test_fedrand_under_secure_aggregation_averages_each_half_as_the_clear_run(vlm_cache, tmp_path):
    """FedRand's per-half average from the survivors' masked sum alone: the same adapter as the
    clear run of the same seed (every client's half weighted by its examples), the same per-half
    counts, and nothing of a client's adapter in clear on the way up. In round 2 each client is
    sent only its half, as in the clear run (the layer used to skip FedRand's note of who had
    trained, so every secure round sent both halves)."""
    extra = {"num-server-rounds": 2, "fraction-train": 1.0, "replies.max-norm": 100.0}
    _, clear = _run(_raw(vlm_cache, tmp_path / "clear", "fedrand", **extra))
    _, secure = _run(_raw(vlm_cache, tmp_path / "secure", "fedrand", **extra, **{"secure-aggregation.enabled": True}))
    counts = list(FEDRAND_CLIENTS.values())
    for a, b in zip(clear.data["rounds"], secure.data["rounds"], strict=True):
        assert b["secure_aggregation"]["masked"] == N_CLIENTS and b["bytes"]["train_up"] == 0
        assert [b["metrics"][c] for c in counts] == [a["metrics"][c] for c in counts]
        down = {name: (c["fedrand/first"], c["train/bytes_down"]) for name, c in a["clients"].items()}
        assert {name: (c["fedrand/first"], c["train/bytes_down"]) for name, c in b["clients"].items()} == down
    assert not any(c["fedrand/first"] for c in secure.data["rounds"][1]["clients"].values())
    before = torch.load(clear.dir / "final_shared.pt", weights_only=True)["arrays"]
    after = torch.load(secure.dir / "final_shared.pt", weights_only=True)["arrays"]
    assert before.keys() == after.keys()
    for name in before:
        # the sum's fixed-point rounding (about 1e-6 a round) moves round 2's training a little,
        # and Adam's step magnifies it on a coordinate whose gradient is near zero: the tensor as
        # a whole, not each coordinate
        diff = np.linalg.norm(after[name].numpy() - before[name].numpy())
        assert diff <= 1e-3 * np.linalg.norm(before[name].numpy()), name
