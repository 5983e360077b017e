"""The strategy base every method builds on (a Flower Message-API ``Strategy``).

It implements Flower's hooks (``configure_train``, ``aggregate_train``, ``configure_evaluate``,
``aggregate_evaluate``) for every method, on parts that live elsewhere:
- the node registry (``strategies.nodes``): handshake, waiting for nodes, seeded sampling;
- the run's privacy budget (``privacy.budget``): the plan, what records have spent, the stop;
- per-node messages: a subclass decides what each node receives and must send back
  (``train_payload`` / ``evaluate_payload`` return a ``Payload``), e.g. FedRand's per-node half;
  the plan for the node's local training travels with it (``protocol.TrainInstruction``);
- reply validation (``strategies.validation``): a reply with an error, wrong tensors or shapes,
  another dtype than float32, non-finite values, malformed metrics or more examples than the
  node's handshake reported is dropped with a logged, recorded reason.

What cuts across methods wraps the strategy (``strategies.layers``): the reply bound, the
server's global noise and secure aggregation each reach it only through its hooks and the
steps of a round's training it makes public (``validate``, ``aggregate_updates``,
``aggregate_sums``, ``train_result``).

The loop (``server_app.loop``) owns the round, as Flower's ``Strategy.start`` does: it admits the
nodes that joined before each phase, passes the global arrays and the phase's config to
``configure_*`` and uses what they and ``aggregate_*`` return. ``configure_*`` only build
messages: they sample among the connected nodes and keep what they sent, and what validation
later finds, in the round's plan (``strategies.plan``, kept by round in ``plans``); the loop
builds the round's record from that plan. Subclasses implement ``initial_arrays`` and
``aggregate`` and may override the payload hooks; they record per-client figures only through
``Payload.rows`` and per-round figures only through what ``aggregate`` returns.

Everything a strategy carries from one round to the next goes in and out through one pair,
``state_dict`` / ``load_state_dict`` (tensors, numbers, strings, lists and dicts only, so that
``torch.load(weights_only=True)`` reads it back); a subclass with state of its own extends both.
Every random draw is keyed by the seed and the round (``utils.rng``), so no generator state
needs saving: the loop checkpoints this after every round and a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedvlm.metrics import (
    EVAL_CLIENTS,
    EVAL_COMPUTE_SECONDS,
    EVALUATE,
    TRAIN,
    TRAIN_CLIENTS,
    TRAIN_COMPUTE_SECONDS,
    round_figures,
)
from fedvlm.privacy.accounting import BudgetError
from fedvlm.privacy.budget import NoBudget, RunBudget
from fedvlm.privacy.ledger import PrivacyLedger
from fedvlm.privacy.planner import ClientShape, GlobalDP
from fedvlm.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    FINAL_ROUND,
    RUN_DIR,
    EvaluateInstruction,
    TrainInstruction,
)
from fedvlm.runconfig import ConfigError, pins
from fedvlm.spec import spec_of
from fedvlm.strategies.nodes import NodeInfo, NodeRegistry
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import Outgoing, Payload, PhasePlan, RoundPlan
from fedvlm.strategies.records import EVAL_ROW, TRAIN_ROW, ClientUpdate, RoundSum, RunOutputs
from fedvlm.strategies.validation import (
    NAMES_SHOWN,
    ReplyRejected,
    bounded,
    check_evaluate_reply,
    check_train_reply,
    record_nbytes,
)
from fedvlm.utils.rng import ServerStream

log = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    """A run cannot continue from its run folder (the message says why and what to do)."""


def to_tensors(named: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Arrays as tensors, copied, for a state dict."""
    return {k: torch.from_numpy(np.array(v)) for k, v in named.items()}


def to_arrays(named: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A state dict's tensors back as arrays."""
    return {k: v.numpy().copy() for k, v in named.items()}


class FederatedStrategy(Strategy):
    # how the method's aggregate reads as a sum (secure aggregation, ``aggregate_sums``): each
    # update weighted by its node's examples (a weighted average), or by one (a plain sum)
    sum_weighted = True

    def __init__(self, parts: RunParts):
        self.parts = parts  # the run's parts, which the loop owns (strategies.parts)
        self.cfg = parts.cfg
        self.spec = spec_of(parts.cfg)
        self.privacy = parts.cfg.privacy

    def backbone(self) -> dict | None:
        """results.json's record of the weights the run started from: the fingerprint every node
        must match (set by each family's strategy). Runs on two sets of weights are not one
        method's seeds, so every family records it (``sweep.backbone``)."""
        fp = self.registry.server_fingerprint
        return {"fingerprint": fp} if fp else None

    # the run's parts, as the hooks read them
    @property
    def ledger(self) -> PrivacyLedger:
        return self.parts.ledger

    @property
    def registry(self) -> NodeRegistry:
        return self.parts.registry

    @property
    def budget(self) -> RunBudget | NoBudget:
        return self.parts.budget

    @property
    def plans(self) -> dict[int, RoundPlan]:
        return self.parts.plans

    @property
    def global_arrays(self) -> dict[str, np.ndarray]:
        return self.parts.arrays

    @global_arrays.setter
    def global_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.parts.arrays = arrays

    @property
    def nodes(self) -> dict[int, NodeInfo]:
        return self.registry.nodes

    # ---- hooks for methods -----------------------------------------------------------------
    def initial_arrays(self) -> dict[str, np.ndarray]:
        """The shared arrays before round 1; called once the nodes are known."""
        return {}

    def num_classes(self) -> int:
        """The class count every node reported in the handshake."""
        return next(iter(self.nodes.values())).num_classes

    def num_rounds(self) -> int:
        return self.cfg.num_server_rounds

    def train_payload(self, node: NodeInfo, server_round: int, arrays: dict[str, np.ndarray]) -> Payload:
        """What ``node`` is sent to train on (default: every global array) and must send back
        (default: the shared ones). Called only while configuring: keep it free of effects, the
        round may not be sent (the budget's stop)."""
        shared = self.spec.shares(self.cfg, arrays)
        return Payload(dict(arrays), {k: v.shape for k, v in arrays.items() if k in shared})

    def evaluate_payload(self, node: NodeInfo, server_round: int, arrays: dict[str, np.ndarray]) -> Payload:
        return Payload(dict(arrays))

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, float]:
        """Fold the validated updates into ``self.global_arrays``; the round's figures the method
        adds to its record."""
        return {}

    def aggregate_sums(self, server_round: int, total: RoundSum, updates: list[ClientUpdate]) -> dict[str, float]:
        """``aggregate`` from a sum, where a layer around the strategy gives it one in place of the
        updates (``strategies.secure_aggregation``: what the server learns); ``updates``: the
        validated replies, metrics only. A per-tensor weighted average of the returned tensors, as
        ``aggregate`` computes for every summing method: each tensor moves by its average update; a
        tensor no survivor returned stays as it is."""
        for name, summed in total.sums.items():
            weight = total.weights[name]
            if weight > 0 and name in self.global_arrays:
                current = self.global_arrays[name]
                self.global_arrays[name] = (current + summed.reshape(current.shape) / weight).astype(current.dtype)
        return {}

    def outputs(self, rounds: list[dict]) -> RunOutputs:
        """What the method adds to the run folder after the last round (``rounds``: every
        round's record as written)."""
        return RunOutputs()

    def on_reply_accepted(self, node: NodeInfo, phase: str) -> None:
        """Called for every reply that passed validation (phase: 'train' or 'evaluate')."""

    def nodes_per_round(self) -> int:
        """Clients sampled for training each round (the fixed denominator of a DP average)."""
        return min(len(self.nodes), max(1, math.ceil(self.cfg.fraction_train * len(self.nodes))))

    def client_shape(self, node: NodeInfo) -> ClientShape:
        """``node``'s local training per round (batch size, steps): planned here, sent to it."""
        return self.spec.family.local_shape(self.cfg, node.num_train)

    # ---- state across rounds (a checkpoint, a resumed run) -----------------------------------
    def state_dict(self) -> dict:
        """What the next round depends on: the shared arrays, the privacy spent and its ledger,
        each known node's reported size (a resumed run must find the same nodes) and the weights
        every node loads (a resumed run must continue on them)."""
        return {
            "backbone": self.registry.server_fingerprint,
            "global_arrays": to_tensors(self.global_arrays),
            "nodes": {n.name: n.num_train for n in self.nodes.values()},
            "budget": self.budget.state_dict(),
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (called after ``start``, with the nodes known and planned).
        A node whose size changed would make the spent privacy wrong, and other weights would make
        the rounds so far another model's (an embedded default pretrained again on another CPU):
        ``ResumeError``."""
        began = state.get("backbone")  # a checkpoint written before it was kept has none to compare
        if began and began != self.registry.server_fingerprint:
            raise ResumeError(
                f"the run began on backbone weights {began} and this server loads {self.registry.server_fingerprint}: "
                "its rounds so far trained on other weights; resume it where those weights are (the same cache or "
                "model files), or start it afresh"
            )
        changed = [
            f"{n.name} ({state['nodes'][n.name]} -> {n.num_train} records)"
            for n in self.nodes.values()
            if n.name in state["nodes"] and state["nodes"][n.name] != n.num_train
        ]
        if changed:
            raise ResumeError(
                f"these nodes report other data sizes than before the interruption: {', '.join(changed)}; the "
                "privacy already spent was accounted for the old sizes: restart the nodes on the data they had"
            )
        self.global_arrays = to_arrays(state["global_arrays"])
        try:
            self.budget.check_resumable(state["budget"])
        except BudgetError as why:
            raise ResumeError(str(why)) from why
        self.ledger.load_state_dict(state["ledger"])

    # ---- the run's setup (called by server_app.loop) ---------------------------------------
    def summary(self) -> None:
        log.info(
            "%s: method %s, %d rounds, fraction-train %.2f, fraction-evaluate %.2f, seed %d",
            type(self).__name__,
            self.spec.name,
            self.num_rounds(),
            self.cfg.fraction_train,
            self.cfg.fraction_evaluate,
            self.cfg.seed,
        )

    def begin(self, grid: Grid, resumed: dict | None = None) -> None:
        """Before round 1: wait for the nodes, then ``prepare`` (``resumed``: the interrupted
        run's saved state)."""
        self.summary()
        self.check_backbone()
        self.registry.wait(grid)
        self.prepare(resumed)

    def check_backbone(self) -> None:
        """Refuse a run whose pinned weights (``backbone-fingerprint``) are not the server's: the
        embedded default is pretrained where it is first needed, and two CPUs pretrain it to two
        sets of weights, whose runs are not one method's seeds (``sweep.backbone``)."""
        pinned, found = self.cfg.backbone_fingerprint, self.registry.server_fingerprint
        if not pins(pinned, found):
            raise ConfigError(
                f"run config 'backbone-fingerprint' = {pinned!r}, but this server loads {found or 'unrecorded weights'}"
                ": put the weights that give it where the server loads them (for the embedded default, the file "
                "of cache-dir's models/ from the machine whose runs have that fingerprint; for real CLIP, the "
                "checkpoint clip.pretrained names), or leave backbone-fingerprint empty"
            )

    def prepare(self, resumed: dict | None = None) -> None:
        """Once the nodes are known: the initial arrays, and, with privacy on, the run's budget
        (``privacy.budget.RunBudget.planned``: every mechanism planned for these nodes, or, for a
        resumed run, for the clients its interrupted run planned for)."""
        self.global_arrays = {k: np.asarray(v) for k, v in self.initial_arrays().items()}
        if not self.privacy.enabled:
            return
        if self.privacy.audit_canaries and self.registry.audited() is None:
            raise ConfigError(
                f"run config 'privacy.audit-node' = {self.privacy.audit_node} names no connected node (partition ids: "
                f"{', '.join(str(n.partition_id) for n in self.nodes.values())}); pick one of them"
            )
        spec = self.spec
        self.parts.budget = RunBudget.planned(
            self.privacy,
            self.ledger,
            self.num_rounds(),
            spec.local_dp(self.cfg) if spec.local_dp else None,
            self._global_dp(),
            {n.name: self.client_shape(n) for n in self.nodes.values()},
            self.registry.noise_sources(),
            ((resumed or {}).get("budget") or {}).get("plan"),
        )

    def _global_dp(self) -> GlobalDP | None:
        """The method's server-side mechanism, or, where the run has the clients draw it in shares
        (``RunParts.shares``), their shares of it, over the coordinates of the tensors it noises."""
        if not self.spec.global_dp:
            return None
        n = self.nodes_per_round()
        mechanism = self.spec.global_dp(self.cfg, n)
        if self.parts.shares is None:
            return mechanism
        node = next(iter(self.nodes.values()))
        expected = self.train_payload(node, 1, self.global_arrays).expected
        dim = sum(int(np.prod(expected[t], dtype=np.int64)) for t in mechanism.tensors)
        return dataclasses.replace(mechanism, distributed=self.parts.shares(dim, n))

    def admit(self, grid: Grid) -> None:
        """Before each phase (called by the loop, never by ``configure_*``): handshake the nodes
        that connected since the last phase; with privacy on, plan the ones that joined late, or
        exclude one the plan cannot cover."""
        self.registry.refresh(grid)
        for nid, node in list(self.nodes.items()):
            if self.budget.is_planned(node.name):
                continue
            try:
                self.budget.admit(node.name, self.client_shape(node), self.registry.noise_sources()[node.name])
            except BudgetError as why:
                self.registry.exclude(nid, str(why))

    # ---- messages ------------------------------------------------------------------------------
    def _phase(
        self, phase: str, server_round: int, arrays: ArrayRecord, config: ConfigRecord, fraction: float
    ) -> list[Message]:
        """Sample ``fraction`` of the connected nodes and build each one's message; the round's
        plan keeps what each node is sent (its payload, for judging its reply)."""
        stream = ServerStream.TRAIN_SAMPLE if phase == "train" else ServerStream.EVALUATE_SAMPLE
        nodes = self.registry.choose(self.registry.connected, server_round, fraction, stream)
        global_arrays = {k: v.numpy() for k, v in arrays.items()}
        plan = self.plans.setdefault(server_round, RoundPlan(server_round))
        kept = PhasePlan(phase, server_round)
        setattr(plan, phase, kept)
        run_dir = str(config.get(RUN_DIR, ""))
        kind = MessageType.TRAIN if phase == "train" else MessageType.EVALUATE
        messages = []
        for node in nodes:
            if phase == "train":
                payload = self.train_payload(node, server_round, global_arrays)
                shape = self.client_shape(node)
                instruction = TrainInstruction(
                    server_round,
                    tuple(sorted(payload.expected)),
                    shape.steps,
                    shape.batch_size,
                    node.num_train,
                    self.budget.local_sigma(node.name),
                    run_dir,
                ).to_config()
            else:  # on the last evaluation clients publish their personalised prompts (client_app.publishing)
                payload = self.evaluate_payload(node, server_round, global_arrays)
                final = bool(config.get(FINAL_ROUND, False))
                instruction = EvaluateInstruction(server_round, final, run_dir).to_config()
            nbytes = record_nbytes(payload.arrays)
            kept.outgoing[node.node_id] = Outgoing(node, payload)
            kept.bytes_down += nbytes
            kept.client(node.name).update({**payload.rows, f"{phase}/bytes_down": nbytes})
            content = RecordDict(
                {
                    ARRAYS_RECORD: ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in payload.arrays.items()}),
                    CONFIG_RECORD: ConfigRecord(instruction),
                }
            )
            messages.append(Message(content, dst_node_id=node.node_id, message_type=kind))
        return messages  # the post records them as it sends them (server_app.post)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round's train messages, built from ``arrays`` (the global arrays) and ``config``
        (the run folder); no I/O: the loop has admitted the nodes (``admit``)."""
        return self._phase("train", server_round, arrays, config, self.cfg.fraction_train)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round's evaluate messages (``config``: the run folder, whether it is the last)."""
        return self._phase("evaluate", server_round, arrays, config, self.cfg.fraction_evaluate)

    def next_stage(self, server_round: int, replies: Iterable[Message]) -> Iterable[Message]:
        """The messages of the round's next stage of training, given the last stage's ``replies``:
        none, the training is one stage (a layer around the strategy may add stages:
        ``strategies.secure_aggregation``)."""
        return []

    # ---- replies -------------------------------------------------------------------------------
    def _sender(self, reply: Message, kept: PhasePlan) -> int:
        """The node a reply concerns. An error the SuperLink writes itself (e.g. 'Node Unavailable'
        for a SuperNode that stopped sending heartbeats) comes from the SuperLink's own id: map it
        back through the message it answers."""
        nid = reply.metadata.src_node_id
        if nid not in self.nodes:
            for sent in kept.messages:
                if sent.metadata.message_id and sent.metadata.message_id == reply.metadata.reply_to_message_id:
                    return sent.metadata.dst_node_id
        return nid

    def _superseded_left_out(self, replies: list[Message], kept: PhasePlan) -> list[Message]:
        """``replies`` without the errors the SuperLink wrote itself for a copy of a message whose
        node answered another copy (a SuperNode killed mid-round and restarted: the SuperLink
        answers the lost copy 'Node Unavailable', the restarted node the copy asked again). Both
        used to be counted in the node's name and both dropped as two replies, losing the
        round's work. The SuperLink's error carries nothing of the node, so leaving it out cannot
        count the node twice."""
        answered = {self._sender(m, kept) for m in replies if not m.has_error()}
        kept_replies = []
        for m in replies:
            nid = self._sender(m, kept)
            if m.has_error() and m.metadata.src_node_id not in self.nodes and nid in answered:
                log.info(
                    "round %s: node %s answered another copy; the SuperLink's %r for this one is left out",
                    kept.round,
                    nid,
                    bounded(m.error.reason or "", 80),
                )
                continue
            kept_replies.append(m)
        return kept_replies

    @staticmethod
    def _origin_problem(reply: Message, nid: int, senders: list[int], kept: PhasePlan) -> str:
        """Why a reply cannot be taken as ``nid``'s answer to this phase ("" if it can). A
        SuperLink delivers one reply per message, from its addressee; in process, or through a
        compromised link, a reply may claim another node's id or come twice. Of two replies in
        one node's name neither is counted: the server cannot tell which is the node's, and
        counting both would weigh the node twice in the aggregate and in the accounting."""
        asked: dict[int, set[str]] = {}  # node id -> the ids of the messages it was sent (a copy asked again too)
        for m in kept.messages:
            asked.setdefault(m.metadata.dst_node_id, set()).add(m.metadata.message_id)
        if nid not in asked:
            return "it answers no message the server sent it in this phase of the round"
        if senders.count(nid) > 1:
            return f"{senders.count(nid)} replies came in this node's name in this phase: none is counted"
        if all(asked[nid]) and reply.metadata.reply_to_message_id not in asked[nid]:
            return "it answers another message than the one the server sent this node"
        return ""

    def validate(self, replies: Iterable[Message], kept: PhasePlan) -> list[ClientUpdate]:
        """The replies that concern ``kept`` (an exchange may carry two phases, ``server_app.post``),
        checked; what was dropped, and who did not answer, recorded in ``kept``. A reply concerns
        the phase whose message it answers; one that answers no message of a phase in progress
        (forged, or mangled on the way) is judged, and recorded, by the training's phase where
        one is in progress, else by the evaluation's."""
        good = []
        sent = {m.metadata.message_id: m for m in kept.messages}
        live = [p for plan in self.plans.values() for p in (plan.train, plan.evaluate) if p is not None]
        known = {m.metadata.message_id for p in live for m in (*p.messages, *p.stage_messages)}
        judges_strays = kept.phase == "train" or not any(p.phase == "train" for p in live)
        replies = [
            m
            for m in replies
            if m.metadata.reply_to_message_id in sent or judges_strays and m.metadata.reply_to_message_id not in known
        ]
        replies = self._superseded_left_out(replies, kept)
        senders = [self._sender(m, kept) for m in replies]
        for msg, nid in zip(replies, senders, strict=True):
            node = self.nodes.get(nid)
            name = node.name if node else str(nid)
            try:
                if node is None:  # the aggregation needs the node it comes from
                    raise ReplyRejected("it comes from a node the server does not know")
                why = self._origin_problem(msg, nid, senders, kept)
                if why:
                    raise ReplyRejected(why)
                out = kept.outgoing.get(nid)
                answered = sent.get(msg.metadata.reply_to_message_id)
                carried = answered is not None and answered.metadata.message_type == MessageType.TRAIN
                expected = out.payload.expected if out and kept.tensors_in_replies else {}
                reply, refused = (
                    check_train_reply(msg, expected, node.num_train, kept.layer_tensors)
                    if kept.phase == "train"
                    else check_evaluate_reply(msg, carried, node.evaluation_counts())
                )
            except ReplyRejected as why:
                kept.drop(name, str(why))
                continue
            if refused:
                _refuse_metrics(kept, name, refused)
            self.ledger.note_released(kept.phase, reply.metrics)
            kept.add_up(name, record_nbytes(reply.arrays))
            good.append(ClientUpdate(node, reply))
            self.on_reply_accepted(node, kept.phase)
        for nid in sorted({m.metadata.dst_node_id for m in kept.messages} - set(senders)):
            node = self.nodes.get(nid)
            kept.missing.append({"client": node.name if node else str(nid), "phase": kept.phase})
        return good

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The new global arrays and the round's training figures, from the validated replies to this
        round's train messages (a layer around the strategy may bound them first:
        ``strategies.reply_bound``)."""
        return self.aggregate_updates(server_round, self.validate(replies, self.plans[server_round].phase("train")))

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> tuple[ArrayRecord, MetricRecord]:
        """``updates`` (the replies that count) folded in (``aggregate``), and the round's outcome."""
        kept = self.plans[server_round].phase("train")
        return self.train_result(kept, updates, self.aggregate(server_round, updates) if updates else {})

    def train_result(
        self, kept: PhasePlan, updates: list[ClientUpdate], metrics: dict[str, float]
    ) -> tuple[ArrayRecord, MetricRecord]:
        """The round's outcome once ``updates`` (the replies that count) were folded in with
        ``metrics`` (the method's figures): each client's figures recorded, the round's made."""
        for u in updates:
            kept.client(u.node.name).update({TRAIN_ROW + k: v for k, v in u.reply.metrics.items()})
        metrics.update(round_figures([u.reply.metrics for u in updates], TRAIN))
        metrics[TRAIN_COMPUTE_SECONDS] = float(sum(u.reply.compute_seconds for u in updates))
        metrics[TRAIN_CLIENTS] = len(updates)
        arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in self.global_arrays.items()})
        return arrays, MetricRecord(dict(metrics))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        kept = self.plans[server_round].phase("evaluate")
        updates = self.validate(replies, kept)
        for u in updates:
            kept.client(u.node.name).update({EVAL_ROW + k: v for k, v in u.reply.metrics.items()})
        metrics = round_figures([u.reply.metrics for u in updates], EVALUATE)
        metrics[EVAL_CLIENTS] = len(updates)
        metrics[EVAL_COMPUTE_SECONDS] = float(sum(u.reply.compute_seconds for u in updates))
        return MetricRecord(dict(metrics))


def _refuse_metrics(kept: PhasePlan, name: str, refused: dict[str, str]) -> None:
    why = bounded(next(iter(refused.values())))
    log.warning("round %s: left out %d metric(s) of %s's %s reply: %s", kept.round, len(refused), name, kept.phase, why)
    kept.refused_metrics.append(
        {
            "client": name,
            "phase": kept.phase,
            "count": len(refused),
            "metrics": [bounded(k, 64) for k in list(refused)[:NAMES_SHOWN]],
            "reason": why,
        }
    )
