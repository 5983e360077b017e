"""Secure aggregation through the wire, against the two parties it must hold against: a SuperLink
host that rewrites what the real ServerApp sends (``HostileGrid``: the request each real node
receives), and a hostile member whose stage replies are malformed. The nodes are the project's
real ClientApp (its handlers inside the secure-aggregation layer), in a real in-process federation.

What the server must never get: a node's update outside a masked sum (a stripped plan), a value
of its data in a refusal (a forged bound; any error text: the same bytes for neighbouring
datasets), a sum the plan did not promise (per-node plans, keys off the roster, per-node survivor
stories). What a hostile node must never do: stop the run, or have an update dropped from the
round's record still counted in the sum.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message

from fedvlm.client_app import node_round, trainer
from fedvlm.client_app.app import app as client_app
from fedvlm.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    SECAGG_IDENTITY_KEYS,
    SECAGG_MASKED,
    SECAGG_NODES,
    SECAGG_NORM_BOUND,
    SECAGG_ROSTER,
    SECAGG_STAGE,
    SECAGG_SURVIVORS,
    SECAGG_THRESHOLD,
    SECURE_SUM,
    SERVER_ROUND,
)
from fedvlm.secagg import server as secagg_server
from fedvlm.secagg import stages
from fedvlm.secagg.roster import Identity
from fedvlm.server_app.app import execute
from fedvlm.spec import spec_of
from fedvlm.strategies.nodes import FederationError
from fedvlm.tensor_names import CTX
from fedvlm.utils.inprocess import InProcessGrid
from fedvlm.utils.runtime import in_process_node
from tests.neighbours import one_record_batches

N = 5


class HostileGrid(InProcessGrid):
    """An in-process federation whose SuperLink rewrites each request before its node sees it
    (``rewrite``: the request -> the request delivered)."""

    def __init__(self, *args, rewrite: Callable[[Message], Message] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rewrite = rewrite

    def _answer(self, msg: Message) -> list[Message]:
        if self.rewrite is None:
            return super()._answer(msg)
        return super()._answer(self.rewrite(copy.deepcopy(msg)))  # the ServerApp keeps what it sent


def _stage(msg: Message) -> str:
    return str(msg.content[SECURE_SUM][SECAGG_STAGE]) if SECURE_SUM in msg.content else ""


def _federation(make_cfg, run_id, rewrite=None, intercept=None, nodes=None, n=N, **overrides):
    cfg = make_cfg(
        **{
            "method": "promptfl",
            "num_server_rounds": 1,
            "max_per_class": 6,
            "replies__max_norm": 100.0,
            "secure_aggregation__enabled": True,
            "reply_grace": 0.2,
            **overrides,
        }
    )
    configs = nodes or [{"partition-id": i, "num-partitions": n} for i in range(n)]
    grid = HostileGrid(client_app, configs, cfg.as_dict(), intercept=intercept, rewrite=rewrite)
    rec = execute(cfg, grid, run_id=run_id)
    return rec, json.loads(rec.path.read_text()), grid


def _errors(grid: InProcessGrid, node: int) -> list[str]:
    return [r.error.reason.split("\n")[0] for r in grid.replies if r.has_error() and r.metadata.src_node_id == node]


def _final(rec) -> np.ndarray:
    return torch.load(rec.dir / "final_shared.pt", weights_only=True)["arrays"][CTX].numpy()


def _trained(monkeypatch) -> list[int]:
    """The nodes whose handlers trained (node ids, in order)."""
    calls = []
    honest = node_round.NodeMessage.train

    def train(self, *args):
        calls.append(self.context.node_id)
        return honest(self, *args)

    monkeypatch.setattr(node_round.NodeMessage, "train", train)
    return calls


# ---- a server that deviates -----------------------------------------------------------------------
@pytest.mark.parametrize("who", ["run", "node"])
def test_a_train_message_stripped_of_its_plan_is_refused_before_training(make_cfg, pretrained_clip, monkeypatch, who):
    """The downgrade, to node 1001: the run enables secure aggregation and the SuperLink hands the
    node its train message without the plan (``run``); or the run does not, and the node's own
    config requires it, a requirement the server got around at the handshake (``node``: set
    after it). Either way the node trains nothing and sends nothing."""
    grid_of = {}

    def strip(msg):
        if msg.metadata.dst_node_id == 1001 and msg.metadata.message_type == "train":
            grid_of["grid"].contexts[1001].node_config["require-secure-aggregation"] = "true" if who == "node" else ""
            if SECURE_SUM in msg.content and _stage(msg) == "keys":
                del msg.content[SECURE_SUM]
        return msg

    honest_init = HostileGrid.__init__

    def keep(self, *args, **kwargs):
        honest_init(self, *args, **kwargs)
        grid_of["grid"] = self

    monkeypatch.setattr(HostileGrid, "__init__", keep)
    trained = _trained(monkeypatch)
    rec, data, grid = _federation(make_cfg, f"stripped-{who}", strip, secure_aggregation__enabled=who == "run")
    (why,) = _errors(grid, 1001)
    assert "carries no secure-sum plan: refused before training" in why
    assert 1001 not in trained and len(set(trained)) == N - 1
    trains = [r for r in grid.replies if r.metadata.src_node_id == 1001 and r.metadata.message_type == "train"]
    assert trains and all(r.has_error() for r in trains)


def test_a_forged_tiny_bound_is_projected_onto_never_refused_with_a_norm(make_cfg, pretrained_clip, monkeypatch):
    """The server plans a bound far below every update (one plan, as every node checks): each
    node projects its update onto it; no refusal, no norm leaves a node, and the global prompt
    moves by at most the bound."""
    bound = 1e-4
    to_config = stages.SumPlan.to_config
    monkeypatch.setattr(stages.SumPlan, "to_config", lambda plan: {**to_config(plan), SECAGG_NORM_BOUND: bound})
    rec, data, grid = _federation(make_cfg, "tiny-bound")
    assert not [r for r in grid.replies if r.has_error()]
    protocol = data["rounds"][0]["secure_aggregation"]
    assert protocol["masked"] == N and "failed" not in protocol
    sent = next(m for m in grid.sent if _stage(m) == "keys").content[ARRAYS_RECORD][CTX].numpy()
    moved = float(np.linalg.norm(_final(rec).astype(np.float64) - sent))
    assert 0 < moved <= bound * 1.01, moved


def _relays_everything(monkeypatch) -> None:
    """The ServerApp itself deviates: it relays every advert, whatever plan it was signed over."""
    monkeypatch.setattr(secagg_server, "_advert_problem", lambda *args: "")


def test_a_plan_handed_out_differently_is_refused_and_nothing_is_summed(make_cfg, pretrained_clip, monkeypatch):
    _relays_everything(monkeypatch)

    def split(msg):
        if msg.metadata.dst_node_id >= 1003 and _stage(msg) == "keys":
            msg.content[SECURE_SUM][SECAGG_THRESHOLD] = int(msg.content[SECURE_SUM][SECAGG_THRESHOLD]) + 1
        return msg

    rec, data, grid = _federation(make_cfg, "two-plans", split)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert "failed" in protocol
    refusals = [e for node in range(1000, 1000 + N) for e in _errors(grid, node)]
    assert refusals and all("signature over this round's plan" in e for e in refusals), refusals


def test_keys_no_rostered_member_signed_are_refused_through_the_wire(make_cfg, pretrained_clip):
    """The SuperLink adds a Sybil's advert (an identity off the roster) to what it relays."""
    sybil = Identity.simulated(12345, 0).public

    def add_sybil(msg):
        if _stage(msg) == "shares":
            record = msg.content[SECURE_SUM]
            pairs = zip(record[SECAGG_NODES], record[SECAGG_IDENTITY_KEYS], strict=True)
            record[SECAGG_IDENTITY_KEYS] = [sybil if n == str(1004) else k for n, k in pairs]
        return msg

    rec, data, grid = _federation(make_cfg, "sybil", add_sybil)
    assert "failed" in data["rounds"][0]["secure_aggregation"]
    for node in range(1000, 1000 + N - 1):
        assert any("not signed by a member of this node's roster" in e for e in _errors(grid, node)), node
    assert any("other public keys than the ones it advertised" in e for e in _errors(grid, 1004))


def test_a_plan_for_another_roster_is_refused_before_training(make_cfg, pretrained_clip, monkeypatch):
    trained = _trained(monkeypatch)

    def other_roster(msg):
        if _stage(msg) == "keys":
            msg.content[SECURE_SUM][SECAGG_ROSTER] = "f" * 64
        return msg

    rec, data, grid = _federation(make_cfg, "other-roster", other_roster)
    assert not trained
    assert all("this node pins roster" in _errors(grid, n)[0] for n in range(1000, 1000 + N))


def test_per_node_survivor_stories_reveal_nothing(make_cfg, pretrained_clip):
    """At the consistency stage the SuperLink tells each node another set of survivors (itself
    and two others): each signs its own story, none gathers a majority, no share is revealed."""

    def stories(msg):
        if _stage(msg) == "consistency":
            u = msg.metadata.dst_node_id
            msg.content[SECURE_SUM][SECAGG_SURVIVORS] = [str(u), str(1000 + (u + 1) % N), str(1000 + (u + 2) % N)]
        return msg

    rec, data, grid = _federation(make_cfg, "stories", stories)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert "failed" in protocol and protocol["revealed"] == 0
    assert not [r for r in grid.replies if _stage_of_reply(r) == "unmask"]


def _stage_of_reply(reply: Message) -> str:
    if reply.has_error() or SECURE_SUM not in reply.content:
        return ""
    return str(reply.content[SECURE_SUM][SECAGG_STAGE])


# ---- what leaves a node: the same bytes for neighbouring datasets ----------------------------------
def _leaking_training(monkeypatch):
    """A training that fails with a text carrying a value of the node's data (its update's norm)."""
    honest = node_round.NodeMessage.train

    def train(self, *args):
        part = honest(self, *args)
        norm = float(sum(float(v.double().norm() ** 2) for v in part.reply.arrays.values()))
        raise ValueError(f"the update's squared norm is {norm!r}")

    monkeypatch.setattr(node_round.NodeMessage, "train", train)


REFUSALS = {
    "stripped plan": lambda msg: (msg.content.__delitem__(SECURE_SUM), msg)[1] if _stage(msg) == "keys" else msg,
    "minority threshold": lambda msg: _set(msg, SECAGG_THRESHOLD, 2),
    "other roster": lambda msg: _set(msg, SECAGG_ROSTER, "0" * 64),
}


def _set(msg: Message, key: str, value) -> Message:
    if _stage(msg) == "keys":
        msg.content[SECURE_SUM][key] = value
    return msg


@pytest.mark.parametrize("case", [*REFUSALS, "leaking error"])
def test_what_a_node_says_is_the_same_for_neighbouring_datasets(make_cfg, pretrained_clip, monkeypatch, case):
    """Partition 0 with one record in its batch or not: every refusal and error text it sends is
    the same bytes, whatever the server did; an error whose text carries a value of its data
    leaves as its class name alone."""
    skew = {"partitioner": "quantity-skew", "quantity_ratios": "4:1:1:1:1"}  # partition 0's size is its own
    cfg = make_cfg(method="promptfl", max_per_class=6, **skew)
    sizes = [
        len(spec_of(cfg).family.node_data(cfg, {"partition-id": i, "num-partitions": N}).part.train) for i in range(N)
    ]
    if case == "leaking error":
        _leaking_training(monkeypatch)
    said = {}
    for world in ("in", "out"):
        monkeypatch.setattr(trainer, "batches", one_record_batches(world, sizes[0], sizes[1:]))
        _, _, grid = _federation(make_cfg, f"{case}-{world}", REFUSALS.get(case), **skew)
        said[world] = _errors(grid, 1000)
    assert said["in"] and said["in"] == said["out"], said
    if case == "leaking error":
        assert "squared norm" not in said["in"][0] and "ValueError (its text is in this node's log" in said["in"][0]


# ---- a hostile member ------------------------------------------------------------------------------
def _replace_masked(data: bytes, dtype="uint64", shape=None):
    def corrupt(request, reply):
        if request.metadata.dst_node_id == 1002 and _stage(request) == "shares" and not reply.has_error():
            real = reply.content[ARRAYS_RECORD][SECAGG_MASKED]
            fake = Array(dtype=dtype, shape=tuple(shape or real.shape), stype=real.stype, data=data)
            reply.content[ARRAYS_RECORD] = ArrayRecord({SECAGG_MASKED: fake})
        return reply

    return corrupt


@pytest.mark.parametrize(
    "how,reason",
    [
        ("not an array", "malformed"),
        ("oversized", "more than"),
        ("another stage", "answers the 'keys' stage"),
    ],
)
def test_a_hostile_nodes_malformed_stage_reply_costs_that_node_only(make_cfg, pretrained_clip, how, reason):
    if how == "not an array":
        corrupt = _replace_masked(b"these bytes are no array at all")
    elif how == "oversized":
        corrupt = _replace_masked(bytes(8 * 10_000_000 // 100), shape=[100])
    else:

        def corrupt(request, reply):
            if request.metadata.dst_node_id == 1002 and _stage(request) == "shares" and not reply.has_error():
                reply.content[SECURE_SUM] = ConfigRecord({**reply.content[SECURE_SUM], SECAGG_STAGE: "keys"})
            return reply

    rec, data, _ = _federation(make_cfg, f"hostile-{how.replace(' ', '-')}", intercept=corrupt)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert data["run"]["status"] == "finished" and "failed" not in protocol
    assert reason in protocol["excluded"]["1002"] and protocol["masked"] == N - 1


def test_a_train_reply_dropped_by_validation_is_not_in_the_sum(make_cfg, pretrained_clip):
    """Node 1003's keys reply carries a clear tensor beside its advert: validation drops it, and so
    does the protocol; the round's record and its sum agree on who is in it."""

    def smuggle(request, reply):
        if request.metadata.dst_node_id == 1003 and _stage(request) == "keys" and not reply.has_error():
            reply.content[ARRAYS_RECORD] = ArrayRecord({CTX: Array(np.zeros((4, 4), dtype=np.float32))})
        return reply

    rec, data, _ = _federation(make_cfg, "smuggled", intercept=smuggle)
    r = data["rounds"][0]
    assert [d["client"] for d in r["dropped"]] == ["client-3"] and r["secure_aggregation"]["masked"] == N - 1
    assert "dropped" in r["secure_aggregation"]["excluded"]["1003"]
    assert r["metrics"]["train-clients"] == N - 1 and "train/train-loss" not in r["clients"].get("client-3", {})


# ---- a deployed node's roster --------------------------------------------------------------------
def test_a_real_node_holds_its_pinned_roster_and_identity_and_refuses_without_them(
    make_cfg, pretrained_clip, monkeypatch, tmp_path
):
    """Nodes that are not simulated: without a roster each is refused at the handshake, naming the
    node config keys; with the federation's roster and their own identity keys (made by
    deploy.credentials) and the ServerApp given the same roster, the round sums; a ServerApp
    relaying for another roster is refused before any node trains."""
    from fedvlm.deploy.credentials import generate
    from fedvlm.utils import runtime

    monkeypatch.setattr(runtime, "simulated", lambda: False)
    names = [f"org-{i}" for i in range(3)]
    generate(tmp_path / "creds", [], [], names)
    bare = [{"partition-id": i, "num-partitions": 3, "noise-source": "seeded"} for i in range(3)]
    with pytest.raises(
        FederationError, match=r"3 node\(s\).*needs this node's roster and identity.*secure-aggregation-roster"
    ):
        _federation(make_cfg, "no-roster", nodes=bare, n=3)
    pinned = [
        {
            **node,
            "secure-aggregation-roster": str(tmp_path / "creds" / "roster.json"),
            "secure-aggregation-identity": str(tmp_path / "creds" / "supernodes" / f"{name}.identity"),
        }
        for node, name in zip(bare, names, strict=True)
    ]
    roster = str(tmp_path / "creds" / "roster.json")
    rec, data, grid = _federation(make_cfg, "roster", nodes=pinned, n=3, secure_aggregation__roster=roster)
    protocol = data["rounds"][0]["secure_aggregation"]
    assert protocol["masked"] == 3 and protocol["signed"] == 3 and "failed" not in protocol
    rec, data, grid = _federation(make_cfg, "simulated-roster", nodes=pinned, n=3)  # the server's is made up
    assert all("this node pins roster" in _errors(grid, n)[0] for n in range(1000, 1003))


class RekeyingGrid(HostileGrid):
    """A SuperLink that hands node 1001 each keys message more times than the protocol does, beside
    the real exchange (its extra answers never reach the ServerApp): again as it was, again under
    another plan of the same round (one participant fewer), and, in round 2, round 1's again and
    a round past the run's last. ``extra``: (what was asked, the node's answer)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra: list[tuple[str, Message]] = []
        self.first: Message | None = None

    def _again(self, label: str, msg: Message) -> None:
        with in_process_node():
            try:
                self.extra.append((label, self.app(msg, self.contexts[1001])))
            except Exception as err:  # noqa: BLE001 - as Flower would: an error reply
                self.extra.append((label, Message(Error(code=1, reason=f"{type(err).__name__}: {err}"), reply_to=msg)))

    def _answer(self, msg: Message) -> list[Message]:
        replies = super()._answer(msg)
        if msg.metadata.dst_node_id != 1001 or _stage(msg) != "keys":
            return replies
        plan = stages.SumPlan.from_config(msg.content[SECURE_SUM])
        self._again("same", copy.deepcopy(msg))
        other = copy.deepcopy(msg)
        fewer = dataclasses.replace(plan, participants=plan.participants[:-1])
        other.content[SECURE_SUM] = ConfigRecord({**msg.content[SECURE_SUM], **fewer.to_config()})  # U1 kept
        self._again("other plan", other)
        if plan.server_round == 1:
            self.first = copy.deepcopy(msg)
        else:
            assert self.first is not None
            self._again("earlier round", copy.deepcopy(self.first))
            later = copy.deepcopy(msg)
            past = dataclasses.replace(plan, server_round=3).to_config()
            later.content[SECURE_SUM] = ConfigRecord({**msg.content[SECURE_SUM], **past})
            later.content[CONFIG_RECORD][SERVER_ROUND] = 3
            self._again("past the run", later)
        return replies


def test_a_node_keys_each_round_once_and_answers_a_copy_as_it_did(make_cfg, pretrained_clip, monkeypatch):
    """The difference attack (a second sum of one update is that update minus nothing new): the
    node trains once per round; a copy of the keys message gets the very reply it sent (its advert
    in round 1, its shares and masked vector in round 2, keyed with the prekey round 1's reply
    carried: no new session, no new training, so no second vector with fresh noise); a second plan
    for the round, an earlier round and a round past the run's last are refused. The run itself is
    unharmed."""
    trained = _trained(monkeypatch)
    cfg = make_cfg(
        method="promptfl",
        num_server_rounds=2,
        max_per_class=6,
        replies__max_norm=100.0,
        secure_aggregation__enabled=True,
        reply_grace=0.2,
    )
    configs = [{"partition-id": i, "num-partitions": N} for i in range(N)]
    grid = RekeyingGrid(client_app, configs, cfg.as_dict())
    rec = execute(cfg, grid, run_id="rekey")
    data = json.loads(rec.path.read_text())
    assert all("failed" not in r["secure_aggregation"] for r in data["rounds"])
    assert [r["metrics"]["train-clients"] for r in data["rounds"]] == [N, N]
    assert trained.count(1001) == 2  # once per round, however often it was asked
    first = {
        m.metadata.reply_to_message_id: m for m in grid.replies if m.metadata.src_node_id == 1001 and not m.has_error()
    }
    answers: dict[str, list[str]] = {}
    for label, reply in grid.extra:
        if reply.has_error():
            answers.setdefault(label, []).append(reply.error.reason)
            continue
        assert label == "same"
        original = first[reply.metadata.reply_to_message_id]
        assert dict(reply.content[SECURE_SUM]) == dict(original.content[SECURE_SUM])
        # round 1's reply carries no tensor, round 2's (prekeyed) the masked vector: the very bytes
        # the node first sent, not a second vector under fresh masks
        sent, again = original.content[ARRAYS_RECORD], reply.content[ARRAYS_RECORD]
        assert list(again.keys()) == list(sent.keys()) and all(again[k].data == sent[k].data for k in sent)
        answers.setdefault(label, []).append(f"the same reply, {len(sent)} tensor(s)")
    assert answers["same"] == ["the same reply, 0 tensor(s)", "the same reply, 1 tensor(s)"]
    assert [r["secure_aggregation"]["prekeyed"] for r in data["rounds"]] == [False, True]
    assert len(answers["other plan"]) == 2 and all("under another plan" in e for e in answers["other plan"])
    assert len(answers["earlier round"]) == 1 and "under an earlier round" in answers["earlier round"][0]
    assert len(answers["past the run"]) == 1 and "of a run of 2 rounds" in answers["past the run"][0]


def test_a_used_prekey_handed_back_is_refused_before_training(make_cfg, pretrained_clip, monkeypatch):
    """Round 3's train message to node 1001 lists the prekey round 2 keyed it with (its U1 of
    round 2): the server would have the node mask a second vector under secrets already shared
    with it. The node took that prekey out of its state when round 2 began, so it refuses before
    training, and the round sums the other nodes' updates."""
    trained = _trained(monkeypatch)
    used: dict[int, dict] = {}

    def reuse(msg):
        if msg.metadata.dst_node_id != 1001 or _stage(msg) != "keys":
            return msg
        record = dict(msg.content[SECURE_SUM])
        keyed_with = stages.read_peer_keys(record)
        server_round = stages.SumPlan.from_config(record).server_round
        if server_round == 2 and keyed_with:
            used[1001] = stages.peer_keys(keyed_with)
        elif server_round == 3:
            msg.content[SECURE_SUM] = ConfigRecord({**record, **used[1001], SECAGG_STAGE: stages.KEYS})
        return msg

    rec, data, grid = _federation(make_cfg, "reused-prekey", reuse, num_server_rounds=3)
    (why,) = _errors(grid, 1001)
    assert "a prekey keys one session at most" in why
    assert trained.count(1001) == 2
    last = data["rounds"][2]["secure_aggregation"]
    assert [r["secure_aggregation"]["prekeyed"] for r in data["rounds"]] == [False, True, True]
    assert "failed" not in last and last["masked"] == N - 1  # a dropout: its error reply is all it sent
