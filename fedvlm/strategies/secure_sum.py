"""The server's side of secure aggregation for a run (``secure-aggregation.enabled``): each train
round becomes four stages of messages (``secagg.stages``), and what the strategy aggregates is the
unmasked sum of the survivors' vectors, never one node's update.

``begin`` plans a round from its train messages: the graph of who shares with whom, the
threshold, and the vector's layout (the union of the tensors the nodes were asked for, with their
sizes); it adds the plan to each train message. ``advance`` takes one stage's replies and returns
the next stage's messages, until the last stage's replies give the sum (``total``). A reply that
is an error, comes from another node than the one asked, or is malformed leaves its node out of
the round with the reason (``secagg.server.ServerRound.excluded``); a round whose sum cannot be
recovered is discarded with its reason (``failed``) and the global arrays stay as they were.

The threshold is never below the number of survivors the noise was planned for (``n_min``):
every node refuses to help unmask fewer (``secagg.node``), so a released sum always carries at
least the planned noise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedvlm.privacy.distributed import DistributedGaussian
from fedvlm.protocol import CONFIG_RECORD, SECAGG_MASKED, SECURE_SUM, SERVER_ROUND
from fedvlm.runconfig.schema import SecureAggregationConfig
from fedvlm.secagg import stages
from fedvlm.secagg.graph import neighbours
from fedvlm.secagg.node import majority_threshold
from fedvlm.secagg.server import SecAggError, ServerRound
from fedvlm.secagg.summand import Summand, plain_gamma
from fedvlm.strategies.plan import PhasePlan
from fedvlm.utils.rng import ServerStream, numpy_rng, server_key

log = logging.getLogger(__name__)


def degree(settings: SecureAggregationConfig, nodes: int) -> int:
    """Each node's number of neighbours in a round of ``nodes``."""
    k = settings.neighbours
    return nodes - 1 if k == 0 or k >= nodes - 1 else k


def threshold(settings: SecureAggregationConfig, nodes: int, n_min: int = 0) -> int:
    """A round's threshold: the configured one, never below a strict majority of a node's share
    holders nor below the survivors the noise was planned for."""
    return max(settings.threshold, majority_threshold(degree(settings, nodes) + 1), n_min)


@dataclass
class SecureRound:
    """One round's protocol as the server runs it."""

    server: ServerRound
    summand: Summand
    stage: str = stages.KEYS
    total: tuple[dict[str, np.ndarray], dict[str, float]] | None = None
    failed: str = ""
    bytes_up: int = 0
    bytes_down: int = 0


class SecureSum:
    def __init__(self, settings: SecureAggregationConfig, seed: int, weighted: bool):
        self.settings = settings
        self.seed = seed
        self.weighted = weighted  # each update weighted by its node's examples (else a plain sum)
        self.rounds: dict[int, SecureRound] = {}

    def begin(self, server_round: int, kept: PhasePlan, noise: DistributedGaussian | None, norm_bound: float) -> None:
        """Plan round ``server_round``'s secure sum over its train messages (in ``kept``) and add
        each node's part of the plan to its message."""
        nodes = sorted(kept.outgoing)
        layout: dict[str, int] = {}
        for out in kept.outgoing.values():
            for name, shape in out.payload.expected.items():
                layout[name] = int(np.prod(shape, dtype=np.int64))
        names = tuple(sorted(layout))
        k = degree(self.settings, len(nodes))
        n_min = noise.n_min if noise is not None else 0
        t = threshold(self.settings, len(nodes), n_min)
        graph = neighbours(nodes, k, numpy_rng(server_key(self.seed, server_round, ServerStream.SECAGG_GRAPH)))
        if t > k + 1:
            raise SecAggError(
                f"round {server_round} has {len(nodes)} nodes to train: too few for a threshold of {t} (the noise "
                f"is planned for {n_min} survivors)"
            )
        weight = max((o.node.num_train for o in kept.outgoing.values()), default=1) if self.weighted else 1
        gamma = noise.gamma if noise is not None else plain_gamma(len(nodes), weight, norm_bound, self.settings.bits)
        plan = stages.SumPlan(
            t,
            (),
            self.settings.bits,
            names,
            tuple(layout[n] for n in names),
            self.weighted,
            gamma,
            norm_bound,
            noise.client_sigma if noise is not None else 0.0,
            n_min,
        )
        summand = Summand(plan)
        self.rounds[server_round] = SecureRound(ServerRound(server_round, t, plan.bits, summand.length, graph), summand)
        for msg in kept.messages:
            own = stages.SumPlan(**{**plan.__dict__, "neighbours": graph[msg.metadata.dst_node_id]})
            msg.content[SECURE_SUM] = ConfigRecord(own.to_config())
        kept.secure = self.report(server_round)

    def advance(self, server_round: int, replies: list[Message], kept: PhasePlan) -> list[Message]:
        """The next stage's messages, from this stage's ``replies`` (none once the sum is known or
        the round failed)."""
        secure = self.rounds.get(server_round)
        if secure is None or secure.total is not None or secure.failed:
            return []
        stage_messages = kept.messages if secure.stage == stages.KEYS else kept.stage_messages
        asked = {
            m.metadata.message_id: m.metadata.dst_node_id
            for m in stage_messages
            if stages.stage_of(m.content[SECURE_SUM]) == secure.stage  # copies asked again too
        }
        answers = self._answers(secure, replies, asked)
        server = secure.server
        try:
            if secure.stage == stages.KEYS:
                views = server.take_adverts(self._read(secure, answers, stages.read_keys_reply))
                out = {u: stages.peer_keys(v) for u, v in views.items()}
            elif secure.stage == stages.SHARES:
                routed = server.take_shares(self._read(secure, answers, stages.read_shares_reply))
                out = {u: stages.dealt(c) for u, c in routed.items()}
            elif secure.stage == stages.MASKED:
                vectors = self._read(secure, answers, _masked_vector)
                complaints = self._read(secure, answers, stages.read_complaints)
                requests = server.take_masked(vectors, complaints)
                out = {u: stages.unmask(*r) for u, r in requests.items()}
            else:
                total = server.unmask(self._read(secure, answers, stages.read_shares_back))
                secure.total = secure.summand.decode(total)
                out = {}
        except SecAggError as why:
            secure.failed = str(why)
            log.error("round %d: secure aggregation failed, the round's updates are discarded: %s", server_round, why)
            out = {}
        if not out and secure.total is None and not secure.failed:
            secure.failed = f"no node is left in round {server_round}'s secure sum after its {secure.stage} stage"
            log.error("round %d: %s; the round's updates are discarded", server_round, secure.failed)
        kept.secure = self.report(server_round)
        if not out:
            return []
        secure.stage = stages.STAGES[stages.STAGES.index(secure.stage) + 1]
        messages = []
        for node, record in out.items():
            content = RecordDict(
                {CONFIG_RECORD: ConfigRecord({SERVER_ROUND: server_round}), SECURE_SUM: ConfigRecord(record)}
            )
            secure.bytes_down += _nbytes(record)
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        kept.stage_messages.extend(messages)
        return messages

    def total(self, server_round: int) -> tuple[dict[str, np.ndarray], dict[str, float], list[int]] | None:
        """The round's (sums, weights, by tensor, flat; the survivors' node ids), or None if it failed."""
        secure = self.rounds.get(server_round)
        if secure is None or secure.total is None:
            return None
        sums, weights = secure.total
        return sums, weights, sorted(secure.server.masked)

    def report(self, server_round: int) -> dict:
        """What results.json records of the round's protocol (``rounds[].secure_aggregation``): its
        parameters (threshold, neighbours, modulus, the nodes' clip bound and quantisation step,
        the vector's length), who took part at each stage and who was left out and why, what it
        cost in bytes, the noise shares, and why the round failed, if it did."""
        secure = self.rounds[server_round]
        plan = secure.summand.plan
        out = {
            **secure.server.report(),
            "norm_bound": plan.norm_bound,
            "gamma": plan.gamma,
            "weighted": plan.weighted,
            "coordinates": secure.summand.length,
            "stage": secure.stage,
            "bytes_up": secure.bytes_up,
            "bytes_down": secure.bytes_down,
        }
        noise = secure.summand.noise
        if noise is not None:
            out["noise"] = {**noise.as_dict(), "wrap_probability": noise.wrap_probability(len(secure.server.graph))}
        if secure.failed:
            out["failed"] = secure.failed
        return out

    def finish(self, server_round: int) -> None:
        self.rounds.pop(server_round, None)

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _answers(secure: SecureRound, replies: list[Message], asked: Mapping[str, int]) -> dict[int, Message]:
        """The replies to this stage's messages, by node: only from the node asked, the first one."""
        out: dict[int, Message] = {}
        for reply in replies:
            node = asked.get(reply.metadata.reply_to_message_id)
            if node is None:
                continue
            if reply.has_error():
                continue  # the node dropped out of this stage (its error, or the SuperLink's, in the logs)
            if reply.metadata.src_node_id != node:
                secure.server.excluded.setdefault(node, "a reply in its name came from another node")
                continue
            out.setdefault(node, reply)
            secure.bytes_up += sum(_nbytes(dict(r)) for r in reply.content.config_records.values())
            secure.bytes_up += sum(a.numpy().nbytes for r in reply.content.array_records.values() for a in r.values())
        return out

    @staticmethod
    def _read(secure: SecureRound, answers: Mapping[int, Message], read) -> dict:
        """Each answer's stage record read with ``read``; an unreadable one leaves its node out."""
        out = {}
        for node, reply in answers.items():
            try:
                record = reply.content[SECURE_SUM] if SECURE_SUM in reply.content else None
                if not isinstance(record, ConfigRecord):
                    raise stages.MalformedStage("its reply carries no secure-sum record")
                out[node] = read(dict(record)) if read is not _masked_vector else read(reply)
            except (stages.MalformedStage, ValueError, TypeError) as why:
                secure.server.excluded.setdefault(node, f"its {secure.stage} reply is malformed: {why}")
        return out


def _masked_vector(reply: Message) -> np.ndarray:
    record = reply.content.array_records.get(next(iter(reply.content.array_records), ""), None)
    if not isinstance(record, ArrayRecord) or list(record.keys()) != [SECAGG_MASKED]:
        raise stages.MalformedStage(f"a masked reply carries one tensor, {SECAGG_MASKED}")
    array = record[SECAGG_MASKED]
    if array.dtype not in ("uint32", "uint64") or len(array.shape) != 1:
        raise stages.MalformedStage(f"the masked vector is {array.dtype} {array.shape}, not a flat uint32/64 vector")
    return array.numpy().astype(np.uint64)


def _nbytes(record: Mapping) -> int:
    """What a stage record weighs on the wire, roughly: its bytes and 8 per number."""
    total = 0
    for v in record.values():
        for x in v if isinstance(v, list) else [v]:
            total += len(x) if isinstance(x, (bytes, str)) else 8
    return total
