"""What a node does with each message, in whichever process runs it: the ClientApp's own
(``client_app.app``) or the node's warm worker (``client_app.worker``).

Three message types:
- ``query`` (once per node, before training): the node validates the run config (a real node
  also refuses what its node config does not allow it to load or write, ``client_app.node_policy``,
  and a run its own privacy limit cannot take, ``client_app.privacy_floor``), loads its data and
  backbone, and reports who it is (name, sizes, backbone fingerprint). Any problem (bad config,
  missing data, unknown weights) surfaces here as a failed reply, so the server excludes the
  node before the first round with the node's own error message. The audited node
  (``privacy.audit-node``) counts its canary slots among its records (``client_app.audit_node``).
- ``train`` / ``evaluate``: the node's part of the round (``client_app.node_round``: the
  method's client on the arrays the server sent, the node's privacy floor, its state restored
  before and persisted after); the reply goes through the send guard. A train message may carry
  the previous round's evaluation (``protocol.EVALUATE_CONFIG``): the node runs it first,
  exactly as its own message, and the reply carries its metrics beside the training's.

This module only reads messages and hands replies to the send guard. Secure aggregation is a
layer around it (``client_app.secure_aggregation``): these handlers do not know whether a round is
secure.
"""

from __future__ import annotations

from flwr.app import Context, Message, MessageType

from fedvlm.client_app.node_round import NodeMessage, message_parts
from fedvlm.client_app.send_guard import failed_reply, guarded_reply, hello_reply
from fedvlm.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    EVALUATE_ARRAYS,
    EVALUATE_CONFIG,
    EvaluateReply,
)


def hello(msg: Message, context: Context) -> Message:
    return hello_reply(msg, NodeMessage.open(context).hello())


def train(msg: Message, context: Context) -> Message:
    node = NodeMessage.open(context)
    evaluation: EvaluateReply | Exception | None = None
    if EVALUATE_CONFIG in msg.content:
        # The previous round's evaluation came with this message: it runs first, on the state
        # the node ends that round with, as in an evaluate message of its own, with a client of
        # its own round (one costs well under a millisecond to build: docs/results/speed.md).
        # Each part's failure is reported in the reply (``protocol.FAILED``) without taking the
        # other down.
        arrays_key = EVALUATE_ARRAYS if EVALUATE_ARRAYS in msg.content else ARRAYS_RECORD
        try:
            evaluation = node.evaluate(*message_parts(msg.content, EVALUATE_CONFIG, arrays_key))
        except Exception as err:  # noqa: BLE001 - reported to the server, as Flower reports any error
            evaluation = err
    try:
        part = node.train(*message_parts(msg.content, CONFIG_RECORD, ARRAYS_RECORD))
    except Exception as err:
        if evaluation is None:
            raise  # Flower reports it, as for any message
        # As above; nothing of the training leaves the node. What the failed training wrote in
        # the node's state stays (Flower would drop it with the whole message): the state only
        # changes when a round is committed, which is then on disk too, and the node's ledger
        # may count a release that never left: conservative.
        return failed_reply(msg, err, evaluation)
    # the guard holds the reply to what the server named this round (none named = nothing may
    # leave) as well as to the method's shared set
    return guarded_reply(
        msg, part.reply, allowed=part.allowed, private=part.private, requested=part.requested, evaluation=evaluation
    )


def evaluate(msg: Message, context: Context) -> Message:
    reply = NodeMessage.open(context).evaluate(*message_parts(msg.content, CONFIG_RECORD, ARRAYS_RECORD))
    return guarded_reply(msg, reply, allowed=frozenset())


HANDLERS = {MessageType.QUERY: hello, MessageType.TRAIN: train, MessageType.EVALUATE: evaluate}


def handle(msg: Message, context: Context) -> Message:
    return HANDLERS[msg.metadata.message_type](msg, context)
