"""One round as the strategy planned and saw it: what each node was sent and must send back, and
what validation found in the replies.

A strategy keeps one ``RoundPlan`` per round it is running (``FederatedStrategy.plans``, keyed by
round, as Flower's DP wrappers keep their per-round state): ``configure_train`` and
``configure_evaluate`` fill a phase with what each node is sent, the post records the messages
as it sends them (``messages``, ``stage_messages``, the copies it asks again: ``server_app.post``,
their one writer), ``aggregate_*`` add what validation found, and the loop builds the round's
record from the plan and what the aggregation returned (``RoundRecord.of``). Nothing of a round
lives anywhere else, so a round that is planned and not sent (the budget's stop) leaves no trace
once its plan is dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from flwr.app import Message

    from fedvlm.strategies.nodes import NodeInfo


log = logging.getLogger(__name__)


@dataclass
class Payload:
    """What a method sends one node in one phase (``FederatedStrategy.train_payload`` and
    ``evaluate_payload``)."""

    arrays: dict[str, np.ndarray]
    expected: dict[str, tuple] = field(default_factory=dict)  # tensors the reply must carry, with shapes
    rows: dict = field(default_factory=dict)  # per-client figures the method records (e.g. FedRand's half)


@dataclass
class Outgoing:
    node: NodeInfo
    payload: Payload


@dataclass
class PhasePlan:
    """One phase ('train' or 'evaluate') of a round."""

    phase: str
    round: int
    outgoing: dict[int, Outgoing] = field(default_factory=dict)  # node id -> what it was sent
    messages: list[Message] = field(default_factory=list)  # as sent; copies asked again appended
    clients: dict[str, dict] = field(default_factory=dict)  # per-client figures, by name
    dropped: list[dict] = field(default_factory=list)  # rejected replies and why
    refused_metrics: list[dict] = field(default_factory=list)  # metrics left out of kept replies, and why
    bounded: list[dict] = field(default_factory=list)  # updates past their norm bound
    asked_again: list[dict] = field(default_factory=list)  # late replies asked again (server_app.post)
    missing: list[dict] = field(default_factory=list)  # nodes whose reply never came
    # a layer around the strategy may carry the replies' tensors elsewhere (secure aggregation:
    # under masks, in later stages): then the replies carry figures only
    tensors_in_replies: bool = True
    # tensors of the replies the layer reads and checks itself (a prekeyed secure round's masked
    # vector, sent with the train reply), not the strategy's
    layer_tensors: frozenset[str] = frozenset()
    # a secure round's later stages (strategies.secure_aggregation): their messages, copies
    # included, the protocol's account of the round, and its state as the plan made it (taken
    # up when the train replies come: a round dropped unsent takes it away with its plan)
    stage_messages: list[Message] = field(default_factory=list)
    secure: dict | None = None
    protocol: Any = None
    bytes_down: int = 0
    bytes_up: int | None = None  # None until a reply is accepted

    def client(self, name: str) -> dict:
        return self.clients.setdefault(name, {})

    def add_up(self, name: str, nbytes: int) -> None:
        self.bytes_up = (self.bytes_up or 0) + nbytes
        self.client(name)[f"{self.phase}/bytes_up"] = nbytes

    def drop(self, name: str, reason: str) -> None:
        """Record that ``name``'s reply of this phase is not used, and why."""
        from fedvlm.strategies.validation import REASON_CHARS, bounded

        reason = bounded(reason, REASON_CHARS + 200)  # the server's words around what the node sent, itself bounded
        log.warning("round %s: dropped the %s reply of %s: %s", self.round, self.phase, name, reason)
        self.dropped.append({"client": name, "phase": self.phase, "reason": reason})


@dataclass
class RoundPlan:
    round: int
    train: PhasePlan | None = None  # None: the method does not train, or the round was not sent
    evaluate: PhasePlan | None = None

    @property
    def sampled(self) -> int:
        """Clients sent a train message this round."""
        return len(self.train.outgoing) if self.train is not None else 0

    def phase(self, phase: str) -> PhasePlan:
        found = self.train if phase == "train" else self.evaluate
        if found is None:
            raise KeyError(f"round {self.round} has no {phase} phase planned")
        return found
