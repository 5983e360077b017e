"""A round's messages between the strategy's hooks and the grid, with one owner: the post.

The strategy's ``configure_*`` and ``next_stage`` build messages and return them; the post is the
only writer of what a round sent (``PhasePlan.messages`` and ``stage_messages``, which the
strategy then reads to judge the replies). It keeps its own map from every message it sent to
the round and phase it belongs to (``Posted``), so that nothing is read back from a message's
config, and it forgets a round's messages when the loop takes the round's plan (``take``).

What it does with them:
- ``send``: one exchange: this round's train messages and the previous round's evaluation, one
  message per node (``_bundle``: a node sampled for both gets one message carrying both);
- ``send_stage``: a secure round's later stage (the messages ``next_stage`` returned);
- for a late reply, a copy of its message, once (``_ask_again``; ``server_app.exchange`` decides
  when a reply is late), charged to the node's records where a copy is a new release.

It needs three things of the run (``Desk``, which ``strategies.parts.RunParts`` is): the plan of a
round's phase, a node's name, and the privacy charge of asking a node again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedvlm.protocol import ARRAYS_RECORD, ATTEMPT, CONFIG_RECORD, EVALUATE_ARRAYS, EVALUATE_CONFIG
from fedvlm.server_app.exchange import Exchanger
from fedvlm.strategies.plan import PhasePlan, RoundPlan
from fedvlm.strategies.validation import record_nbytes


class Desk(Protocol):
    """What the post needs of the run (``strategies.parts.RunParts``)."""

    def phase(self, server_round: int, phase: str) -> PhasePlan: ...
    def node_name(self, node_id: int) -> str | None: ...
    def charge_replay(self, name: str, server_round: int) -> tuple[bool, float | None]: ...
    def take_plan(self, server_round: int) -> RoundPlan: ...


@dataclass(frozen=True)
class Posted:
    """What the post knows of a message it sent."""

    round: int
    phase: str  # "train" or "evaluate"
    stage: bool = False  # a secure round's later stage: it runs on what the node kept, no training
    carries: int | None = None  # the round of the evaluation it carries (``_bundle``)


class Post:
    """Sends each round's messages for a whole run (the module docstring)."""

    def __init__(self, desk: Desk, exchange: Exchanger):
        self.desk = desk
        self.exchange = exchange
        self.posted: dict[int, tuple[Message, Posted]] = {}  # id(message) -> the message (kept alive), what it is

    def send(
        self, server_round: int | None, train: list[Message], evaluated: int | None, evaluation: list[Message]
    ) -> list[Message]:
        """One exchange: round ``server_round``'s ``train`` messages and round ``evaluated``'s
        ``evaluation`` (both as ``configure_*`` returned them); every reply pulled."""
        if train:
            assert server_round is not None
            self._record(train, Posted(server_round, "train"))
        if evaluation:
            assert evaluated is not None
            train = self._bundle(train, evaluated, evaluation)
        return self.exchange.run(train, self._ask_again)

    def send_stage(self, server_round: int, messages: list[Message]) -> list[Message]:
        """A later stage of round ``server_round``'s training (``next_stage``); its replies."""
        self._record(messages, Posted(server_round, "train", stage=True))
        return self.exchange.run(messages, self._ask_again)

    def take(self, server_round: int) -> RoundPlan:
        """Round ``server_round``'s plan, taken from the run; its messages forgotten here."""
        self.posted = {k: v for k, v in self.posted.items() if v[1].round != server_round}
        return self.desk.take_plan(server_round)

    def _record(self, messages: list[Message], posted: Posted) -> None:
        kept = self.desk.phase(posted.round, posted.phase)
        (kept.stage_messages if posted.stage else kept.messages).extend(messages)
        for msg in messages:
            self.posted[id(msg)] = (msg, posted)

    def _bundle(self, train: list[Message], evaluated: int, evaluation: list[Message]) -> list[Message]:
        """The exchange's messages, one per node. A node in both gets its evaluation inside its
        train message (``protocol.EVALUATE_CONFIG``; the arrays too, as ``EVALUATE_ARRAYS``, only
        where they differ from the training's), and the evaluation's plan keeps that message as
        the one it sent the node.

        Why nothing changes for the node: it runs the evaluation first, with the state it would
        have had for an evaluate message of its own (nothing happens to its state between the two
        messages), and on the arrays that message would have carried. Why nothing changes for the
        server: the evaluation's figures come back in their own record and are validated and
        aggregated by ``aggregate_evaluate`` of their round; a reply that fails fails both."""
        kept = self.desk.phase(evaluated, "evaluate")
        hosts = {m.metadata.dst_node_id: m for m in train}
        alone, sent = [], []
        for msg in evaluation:
            host = hosts.get(msg.metadata.dst_node_id)
            if host is not None:
                self._carry(host, msg, kept)
                self.posted[id(host)] = (host, Posted(self.posted[id(host)][1].round, "train", carries=evaluated))
            else:
                alone.append(msg)
                self.posted[id(msg)] = (msg, Posted(evaluated, "evaluate"))
            sent.append(host if host is not None else msg)
        kept.messages.extend(sent)
        return train + alone

    def _carry(self, host: Message, msg: Message, kept: PhasePlan) -> None:
        """``msg``'s evaluation put into ``host``, a train message to the same node."""
        host.content[EVALUATE_CONFIG] = msg.content[CONFIG_RECORD]
        arrays, shared = msg.content[ARRAYS_RECORD], host.content[ARRAYS_RECORD]
        assert isinstance(arrays, ArrayRecord) and isinstance(shared, ArrayRecord)  # configure_* send them
        if not _same_arrays(arrays, shared):
            host.content[EVALUATE_ARRAYS] = arrays
            return
        kept.bytes_down -= record_nbytes({k: v.numpy() for k, v in arrays.items()})  # nothing more to send
        name = self.desk.node_name(host.metadata.dst_node_id)
        assert name is not None  # configure_* address only known nodes
        kept.client(name)["evaluate/bytes_down"] = 0

    def _ask_again(self, late: list[Message]) -> list[Message]:
        """Copies of the messages whose replies are late, to send once more; a message left out
        is not asked again, and why is recorded in the round.

        Why the accounting still holds: the budget spends a round for each trainee when its
        train message is sent (``RunBudget.charge_round``), because a lost reply may still have
        been computed and seen. A copy of a train message makes the node compute again. With the
        node's and the server's noise seeded, the node restores its state of the round before
        and releases the same tensors again: nothing is charged, as for a resumed round. With OS
        noise anywhere it is a second, independent release: the node's round is spent again, and
        the copy is not sent if that would take its records past the epsilon the run promised,
        counting the rounds still to come (``RunBudget.charge_replay``). Only one reply per node
        enters the aggregate (the exchange pulls the first to come), so the server's noise is
        added once."""
        copies = []
        for msg in late:
            name = self.desk.node_name(msg.metadata.dst_node_id)
            if name is not None:
                copy = self._copy(msg, name)
                copies += [copy] if copy is not None else []
        return copies

    def _copy(self, msg: Message, name: str) -> Message | None:
        """The copy of ``msg`` (to ``name``) to send, recorded in its round; None if it may not go."""
        posted = self.posted[id(msg)][1]
        kept = self.desk.phase(posted.round, posted.phase)
        trains = posted.phase == "train" and not posted.stage  # later stages run on what the node kept
        charged, over = self.desk.charge_replay(name, posted.round) if trains else (False, None)
        if over is not None:
            why = f"asking again would bring epsilon to {over:.4g}, past what the run promised"
            kept.asked_again.append({"client": name, "phase": posted.phase, "asked": False, "why": why})
            return None
        content = RecordDict(dict(msg.content.items()))  # a bundled evaluation too
        config = content[CONFIG_RECORD]
        assert isinstance(config, ConfigRecord)  # configure_* and next_stage send one
        content[CONFIG_RECORD] = ConfigRecord({**config, ATTEMPT: 2})
        copy = Message(content, dst_node_id=msg.metadata.dst_node_id, message_type=msg.metadata.message_type)
        asked = {"client": name, "phase": posted.phase, "asked": True, "charged": charged}
        self._record([copy], posted)
        kept.asked_again.append(asked)
        if posted.carries is not None:  # the evaluation it carries is asked again with it
            evaluated = self.desk.phase(posted.carries, "evaluate")
            evaluated.messages.append(copy)
            evaluated.asked_again.append({**asked, "phase": "evaluate", "charged": False})
        return copy


def _same_arrays(a: ArrayRecord, b: ArrayRecord) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].data == b[k].data for k in a
    )
