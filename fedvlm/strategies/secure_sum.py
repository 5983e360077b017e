"""The server's side of secure aggregation for a run, the protocol's runner that the layer around
the strategy (``strategies.secure_aggregation``) drives: each train round becomes four stages of
messages (``secagg.stages``; three where the nodes keyed it a round ahead), and what the strategy
aggregates is the unmasked sum of the survivors' vectors, never one node's update.

``plan`` builds a round's one plan from its train messages (the participants, the graph's degree,
the threshold, the vector's layout, the noise shares, the roster's digest) and adds it to every
train message; it changes nothing here. ``advance`` takes one stage's replies and returns the
next stage's messages, until the last stage's replies give the sum (``total``); the round's
protocol state is made with its plan (keyed already where the plan carries the nodes' prekeys)
and kept with it, to be taken up when the train replies come. The train replies are those the
strategy accepts (``validate``: the reply checks every reply passes): a node whose reply is
dropped never enters the sum, so the sum and the round's record agree on who is in it.
A stage reply that is an error, comes from another node than the one asked, answers another
stage, or is malformed in any way (bytes that are not an array, a wrong size or type, shares of
nodes it holds none of) leaves its node out of the round with the reason
(``secagg.server.ServerRound.excluded``); the round goes on, or, where the sum cannot be
recovered, is discarded with its reason (``failed``) and the global arrays stay as they were.

The threshold is never below the number of survivors the noise was planned for (``n_min``):
every node refuses a plan that would let the server unmask fewer (``secagg.node.check_plan``), so
a released sum always carries at least the planned noise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedvlm.privacy.distributed import DistributedGaussian
from fedvlm.protocol import CONFIG_RECORD, SECAGG_MASKED, SECAGG_STAGE, SECURE_SUM, SERVER_ROUND
from fedvlm.runconfig.schema import SecureAggregationConfig
from fedvlm.secagg import stages
from fedvlm.secagg.graph import degree
from fedvlm.secagg.node import PREKEYED, majority_threshold
from fedvlm.secagg.roster import Roster
from fedvlm.secagg.server import SecAggError, ServerRound
from fedvlm.secagg.stages import Advert
from fedvlm.secagg.summand import Summand, plain_gamma
from fedvlm.strategies.nodes import NodeInfo
from fedvlm.strategies.plan import PhasePlan
from fedvlm.strategies.records import ClientUpdate, RoundSum

log = logging.getLogger(__name__)

MAX_VECTOR_OVERHEAD = 4096  # bytes an array's header may add to its values


def threshold(settings: SecureAggregationConfig, nodes: int, n_min: int = 0) -> int:
    """A round's threshold: the configured one, never below a strict majority of a node's share
    holders, nor two, nor the survivors the noise was planned for."""
    return max(settings.threshold, majority_threshold(degree(settings.neighbours, nodes) + 1), 2, n_min)


@dataclass
class SecureRound:
    """One round's protocol as the server runs it."""

    server: ServerRound
    summand: Summand
    prekeyed: bool = False  # keyed with the participants' prekeys: the shares come with the training
    stage: str = stages.KEYS
    accepted: dict[int, ClientUpdate] = field(default_factory=dict)  # node id -> its validated train reply
    total: tuple[dict[str, np.ndarray], dict[str, float]] | None = None
    failed: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    # each later stage's seconds, from sending its messages to taking its replies (the keys
    # stage is the training's round trip)
    seconds: dict[str, float] = field(default_factory=dict)
    mark: float = field(default_factory=time.perf_counter)


class SecureSum:
    def __init__(self, settings: SecureAggregationConfig, seed: int, weighted: bool):
        self.settings = settings
        self.seed = seed
        self.weighted = weighted  # each update weighted by its node's examples (else a plain sum)
        self.rounds: dict[int, SecureRound] = {}
        self._roster = Roster.load(Path(settings.roster)) if settings.roster else None
        self.prekeys: dict[int, Advert] = {}  # node -> the prekey its latest train reply carried, unused

    def roster(self, nodes: Iterable[NodeInfo]) -> Roster | None:
        """The roster the server relays for: the federation's (``secure-aggregation.roster``), or,
        in a simulation whose nodes are partitions of one dataset, the simulation's."""
        if self._roster is not None:
            return self._roster
        counts = {n.num_partitions for n in nodes}
        if len(counts) == 1 and (members := counts.pop()) > 0:
            return Roster.simulated(self.seed, members)
        return None

    def plan(
        self,
        server_round: int,
        kept: PhasePlan,
        messages: list[Message],
        noise: DistributedGaussian | None,
        norm_bound: float,
    ) -> stages.SumPlan:
        """Round ``server_round``'s plan over its train ``messages`` (to the nodes ``kept`` planned),
        added to each of them (``SecAggError``: the round cannot be summed securely)."""
        nodes = sorted(kept.outgoing)
        layout: dict[str, int] = {}
        for out in kept.outgoing.values():
            for name, shape in out.payload.expected.items():
                layout[name] = int(np.prod(shape, dtype=np.int64))
        names = tuple(sorted(layout))
        k = degree(self.settings.neighbours, len(nodes))
        n_min = noise.n_min if noise is not None else 0
        t = threshold(self.settings, len(nodes), n_min)
        if t > k + 1:
            raise SecAggError(
                f"round {server_round} has {len(nodes)} nodes to train: too few for a threshold of {t} (the noise "
                f"is planned for {n_min} survivors)"
            )
        weight = max((o.node.num_train for o in kept.outgoing.values()), default=1) if self.weighted else 1
        gamma = noise.gamma if noise is not None else plain_gamma(len(nodes), weight, norm_bound, self.settings.bits)
        roster = self.roster(o.node for o in kept.outgoing.values())
        plan = stages.SumPlan(
            server_round,
            tuple(nodes),
            self.settings.neighbours,
            t,
            self.settings.bits,
            names,
            tuple(layout[n] for n in names),
            self.weighted,
            gamma,
            norm_bound,
            noise.client_sigma if noise is not None else 0.0,
            n_min,
            roster.digest if roster is not None else "",
        )
        secure = kept.protocol = self._keyed(plan, roster)
        record = stages.prekeyed_plan(plan, secure.server.adverts) if secure.prekeyed else plan.to_config()
        for msg in messages:
            msg.content[SECURE_SUM] = ConfigRecord(record)
        kept.secure = _plan_report(plan)
        return plan

    def _keyed(self, plan: stages.SumPlan, roster: Roster | None) -> SecureRound:
        """The round's protocol state, keyed already (U1) from the participants' prekeys where
        every one of them has one on file that every honest node will accept (else the round
        keys afresh). The prekeys stay on file until the round begins (``advance``)."""
        summand = Summand(plan)
        fresh = SecureRound(ServerRound(plan, summand.length, roster), summand)
        held = {u: self.prekeys[u] for u in plan.participants if u in self.prekeys}
        if not self.settings.prekeys or len(held) != len(plan.participants):
            return fresh
        keyed = ServerRound(plan, summand.length, roster)
        try:
            keyed.take_adverts(held, PREKEYED)
        except SecAggError:
            return fresh
        return fresh if keyed.excluded else SecureRound(keyed, summand, prekeyed=True)

    def advance(
        self,
        server_round: int,
        replies: list[Message],
        kept: PhasePlan,
        validate: Callable[[list[Message], PhasePlan], list[ClientUpdate]],
    ) -> list[Message]:
        """The next stage's messages, from this stage's ``replies`` (none once the sum is known or
        the round failed); ``validate``: the strategy's checks of the train replies."""
        secure = self.rounds.get(server_round)
        if secure is None:  # the round begins: its participants' prekeys on file are tried once
            secure = self.rounds[server_round] = kept.protocol
            for u in secure.server.plan.participants:
                self.prekeys.pop(u, None)  # each node sends its unused prekey again with its reply
        if secure.total is not None or secure.failed:
            return []
        if secure.stage != stages.KEYS:
            secure.seconds[secure.stage] = round(time.perf_counter() - secure.mark, 4)
        try:
            out = self._take(secure, replies, kept, validate)
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
        secure.stage = stages.after(secure.stage, secure.prekeyed)
        messages = []
        for node, record in out.items():
            content = RecordDict(
                {CONFIG_RECORD: ConfigRecord({SERVER_ROUND: server_round}), SECURE_SUM: ConfigRecord(record)}
            )
            secure.bytes_down += _nbytes(record)
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        secure.mark = time.perf_counter()
        return messages

    def _take(self, secure: SecureRound, replies: list[Message], kept: PhasePlan, validate) -> dict[int, dict]:
        """This stage's answers taken into the protocol; the next stage's record for each node."""
        server = secure.server
        if secure.stage == stages.KEYS:
            secure.accepted = {u.node.node_id: u for u in validate(replies, kept)}
            answers = self._answers(secure, replies, kept.messages)
            self._keep_prekeys(answers)
            for node in sorted(set(answers) - set(secure.accepted)):
                server.excluded.setdefault(node, "its train reply was dropped (the round's dropped list says why)")
                del answers[node]
            if secure.prekeyed:
                return self._routed(secure, answers)
            adverts = server.take_adverts(self._read(secure, answers, stages.read_keys_reply))
            return {u: stages.peer_keys(adverts) for u in adverts}
        answers = self._answers(secure, replies, kept.stage_messages)
        if secure.stage == stages.SHARES:
            return self._routed(secure, answers)
        if secure.stage == stages.CONSISTENCY:
            signatures = server.take_signatures(self._read(secure, answers, stages.read_story_signature))
            return {u: stages.unmask(signatures) for u in signatures}
        total = server.unmask(self._read(secure, answers, stages.read_shares_back))
        secure.total = secure.summand.decode(total)
        return {}

    def _routed(self, secure: SecureRound, answers: Mapping[int, Message]) -> dict[int, dict]:
        """U2 and U3 from the nodes' shares and masked vectors (one reply each); each survivor's
        next message, the story and the shares dealt to it."""
        server = secure.server

        def dealing(reply: Message) -> tuple[bytes, dict[int, bytes], np.ndarray]:
            record = reply.content[SECURE_SUM]
            assert isinstance(record, ConfigRecord)  # _read checked it
            return (*stages.read_shares_reply(dict(record)), _masked_vector(reply, server.size))

        routed = server.take_shares(self._read(secure, answers, dealing, whole=True))
        return {u: stages.story(server.dealt, server.masked, c) for u, c in routed.items()}

    def _keep_prekeys(self, answers: Mapping[int, Message]) -> None:
        """Each train reply's prekey, kept for the node's next round (checked when a plan uses it)."""
        for node, reply in answers.items():
            record = reply.content.get(SECURE_SUM)
            prekey = stages.read_prekey(dict(record)) if isinstance(record, ConfigRecord) else None
            if prekey is not None:
                self.prekeys[node] = prekey

    def total(self, server_round: int) -> RoundSum | None:
        """The round's sum over its survivors, or None if it failed."""
        secure = self.rounds.get(server_round)
        if secure is None or secure.total is None:
            return None
        sums, weights = secure.total
        return RoundSum(sums, weights, sorted(secure.server.masked))

    def in_sum(self, server_round: int) -> tuple[list[ClientUpdate], dict[str, str]]:
        """The accepted train replies of the nodes whose updates are in the round's released sum
        (none if it failed), and why each other accepted node's is not (name -> reason)."""
        secure = self.rounds.get(server_round)
        if secure is None:
            return [], {}
        members = set(secure.server.masked) if secure.total is not None else set()
        left_out = {}
        for node, update in secure.accepted.items():
            if node not in members:
                why = secure.server.excluded.get(node) or secure.failed or "it dropped out of the protocol"
                left_out[update.node.name] = f"its update is not in the secure sum: {why}"
        return [u for n, u in secure.accepted.items() if n in members], left_out

    def report(self, server_round: int) -> dict:
        """What results.json records of the round's protocol (``rounds[].secure_aggregation``): its
        parameters (threshold, neighbours, modulus, the nodes' bound and quantisation step, the
        vector's length), who took part at each stage and who was left out and why, what it cost
        in bytes, the noise shares, and why the round failed, if it did."""
        secure = self.rounds[server_round]
        out = {
            **_plan_report(secure.summand.plan),
            **secure.server.report(),
            "prekeyed": secure.prekeyed,
            "stage": secure.stage,
            "stage_seconds": dict(secure.seconds),
            "bytes_up": secure.bytes_up,
            "bytes_down": secure.bytes_down,
        }
        noise = secure.summand.noise
        if noise is not None:
            participants = len(secure.summand.plan.participants)
            out["noise"] = {**noise.as_dict(), "wrap_probability": noise.wrap_probability(participants)}
        if secure.failed:
            out["failed"] = secure.failed
        return out

    def finish(self, server_round: int) -> None:
        self.rounds.pop(server_round, None)

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _answers(secure: SecureRound, replies: list[Message], sent: list[Message]) -> dict[int, Message]:
        """The replies to this stage's messages (``sent``, copies asked again too), by node: only
        from the node asked, the first one. Their size is counted from their bytes as they came,
        without decoding anything a node sent."""
        asked = {
            m.metadata.message_id: m.metadata.dst_node_id
            for m in sent
            if stages.stage_of(m.content[SECURE_SUM]) == secure.stage
        }
        out: dict[int, Message] = {}
        for reply in replies:
            node = asked.get(reply.metadata.reply_to_message_id)
            if node is None or reply.has_error():
                continue  # another stage's, or the node dropped out of this one (its error is in the logs)
            if reply.metadata.src_node_id != node:
                secure.server.excluded.setdefault(node, "a reply in its name came from another node")
                continue
            if node in out:
                continue
            out[node] = reply
            secure.bytes_up += _reply_nbytes(reply)
        return out

    @staticmethod
    def _read(secure: SecureRound, answers: Mapping[int, Message], read: Callable, whole: bool = False) -> dict:
        """Each answer read with ``read`` (its stage record; the reply itself where ``whole``); an
        answer that is malformed in any way, or answers another stage, leaves its node out."""
        out = {}
        for node, reply in answers.items():
            try:
                record = reply.content[SECURE_SUM] if SECURE_SUM in reply.content else None
                if not isinstance(record, ConfigRecord):
                    raise stages.MalformedStage("its reply carries no secure-sum record")
                if stages.stage_of(record) != secure.stage:
                    raise stages.MalformedStage(f"it answers the {record.get(SECAGG_STAGE)!r} stage")
                out[node] = read(reply) if whole else read(dict(record))
            except Exception as why:  # noqa: BLE001 - whatever a node sends, it costs that node only
                secure.server.excluded.setdefault(node, f"its {secure.stage} reply is malformed: {why}"[:300])
        return out


def _masked_vector(reply: Message, size: int) -> np.ndarray:
    record = reply.content.array_records.get(next(iter(reply.content.array_records), ""), None)
    if not isinstance(record, ArrayRecord) or list(record.keys()) != [SECAGG_MASKED]:
        raise stages.MalformedStage(f"a masked reply carries one tensor, {SECAGG_MASKED}")
    array = record[SECAGG_MASKED]
    if len(array.data) > 8 * size + MAX_VECTOR_OVERHEAD:
        raise stages.MalformedStage(f"its masked vector holds {len(array.data)} bytes, more than {size} residues")
    if array.dtype not in ("uint32", "uint64") or list(array.shape) != [size]:
        raise stages.MalformedStage(f"the masked vector is {array.dtype} {array.shape}, not a flat uint32/64 ({size},)")
    values = array.numpy()
    if values.dtype not in (np.uint32, np.uint64) or values.shape != (size,):
        raise stages.MalformedStage("the masked vector's bytes do not hold what its header says")
    return values.astype(np.uint64)


def _plan_report(plan: stages.SumPlan) -> dict:
    return {
        "threshold": plan.threshold,
        "bits": plan.bits,
        "asked": len(plan.participants),
        "norm_bound": plan.norm_bound,
        "gamma": plan.gamma,
        "weighted": plan.weighted,
        "coordinates": Summand(plan).length,
        "roster": plan.roster[:16],
    }


def _reply_nbytes(reply: Message) -> int:
    """What a stage reply weighs on the wire, roughly, from its raw bytes."""
    total = sum(_nbytes(dict(r)) for r in reply.content.config_records.values())
    return total + sum(len(a.data) for r in reply.content.array_records.values() for a in r.values())


def _nbytes(record: Mapping) -> int:
    """What a stage record weighs on the wire, roughly: its bytes and 8 per number."""
    total = 0
    for v in record.values():
        for x in v if isinstance(v, list) else [v]:
            total += len(x) if isinstance(x, (bytes, str)) else 8
    return total
