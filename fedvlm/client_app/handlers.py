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
- ``train`` / ``evaluate``: the method's client trainer runs on the arrays the server sent
  this node; the reply goes through the send guard. The node's private state is restored from
  its own disk first where memory lacks it (a restarted SuperNode, a resumed run) and written
  back after (``client_app.state``). A client's ``evaluate`` only evaluates: the handler commits
  what the node keeps and, on the run's last evaluation, publishes the node's model on its own
  disk (``client_app.publishing``). A train message may carry the previous round's evaluation
  (``protocol.EVALUATE_CONFIG``): the node runs it first, exactly as its own message, and the
  reply carries its metrics beside the training's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict

from fedvlm.client_app import privacy_floor
from fedvlm.client_app.audit_node import finish_round, node_canaries
from fedvlm.client_app.node_config import NUM_PARTITIONS, check_node_config
from fedvlm.client_app.node_policy import for_node
from fedvlm.client_app.publishing import publish
from fedvlm.client_app.send_guard import failed_reply, guarded_reply, hello_reply
from fedvlm.client_app.state import persist, restore, state_dir
from fedvlm.methods.validation import validate
from fedvlm.metrics import COMPUTE_SECONDS, NODE_EPSILON
from fedvlm.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    EVALUATE_ARRAYS,
    EVALUATE_CONFIG,
    RUN_DIR,
    SERVER_ROUND,
    EvaluateInstruction,
    EvaluateReply,
    TrainInstruction,
)

if TYPE_CHECKING:
    import torch


def _setup(
    context: Context,
    content: RecordDict,
    training: bool,
    config_key: str = CONFIG_RECORD,
    arrays_key: str = ARRAYS_RECORD,
):
    """The run config, the method, this message's client and arrays, its config, and where the
    node keeps its state; ``config_key``/``arrays_key``: the records a bundled evaluation reads."""
    check_node_config(context.node_config)  # the node's own settings, before anything of the run
    # a real node decides for itself what it loads and where it writes (client_app.node_policy)
    cfg = for_node(validate(context.run_config), dict(context.node_config))
    spec = cfg.spec
    node = spec.family.node_data(cfg, dict(context.node_config))
    config: dict[str, Any] = dict(content[config_key]) if config_key in content else {}
    server_round = int(config.get(SERVER_ROUND, 0))
    where = state_dir(node.config, str(config.get(RUN_DIR, "")), node.partition_id, node.name)
    restore(context.state, where, server_round, training=training)
    client = spec.client(cfg, node, context.state, server_round, node_canaries(cfg, node.partition_id, context.state))
    arrays: dict[str, torch.Tensor] = {}
    if arrays_key in content:
        record = content[arrays_key]
        assert isinstance(record, ArrayRecord)  # the server sends its tensors as one
        arrays = record.to_torch_state_dict()
    return cfg, spec, client, arrays, config, where


def hello(msg: Message, context: Context) -> Message:
    cfg, _, client, _, _, _ = _setup(context, msg.content, training=False)
    report = client.hello()
    # a run the node's own limit cannot take is refused before it starts, not at its first round
    privacy_floor.hello_check(client.node, context.state, cfg, client.records(report.num_train))
    partitions = int(client.node.config.get(NUM_PARTITIONS, 0) or 0) if report.partition_id >= 0 else 0
    return hello_reply(msg, replace(report, num_train=client.records(report.num_train), num_partitions=partitions))


def _evaluation(context: Context, content: RecordDict, config_key: str, arrays_key: str) -> EvaluateReply:
    """One evaluation (its own message's, or one bundled into a train message): the reply, with
    the node's state committed and persisted, and its model published on the run's last."""
    t0 = time.time()
    _, _, client, arrays, config, where = _setup(context, content, False, config_key, arrays_key)
    instruction = EvaluateInstruction.from_config(config)
    reply = client.evaluate(arrays, instruction)
    client.commit()  # a first contact may have initialised the node's own parts
    if instruction.final_round:  # the run's last evaluation: the node publishes on its own disk
        publish(client.node, client.published(arrays), instruction)
    persist(context.state, where, instruction.server_round)
    return reply.with_metrics({COMPUTE_SECONDS: time.time() - t0})


def train(msg: Message, context: Context) -> Message:
    if EVALUATE_CONFIG not in msg.content:
        return _train(msg, context)
    # The previous round's evaluation came with this message: it runs first, on the state the
    # node ends that round with, as in an evaluate message of its own. Each part's failure is
    # reported in the reply (``protocol.FAILED``) without taking the other part down with it.
    arrays_key = EVALUATE_ARRAYS if EVALUATE_ARRAYS in msg.content else ARRAYS_RECORD
    evaluation: EvaluateReply | Exception
    try:
        evaluation = _evaluation(context, msg.content, EVALUATE_CONFIG, arrays_key)
    except Exception as err:  # noqa: BLE001 - reported to the server, as Flower reports any error
        evaluation = err
    try:
        return _train(msg, context, evaluation)
    except Exception as err:  # noqa: BLE001 - as above; nothing of the training leaves the node
        # What the failed training wrote in the node's state stays (Flower would drop it with
        # the whole message): the state only changes when a round is committed, which is then
        # on disk too, and the node's ledger may count a release that never left: conservative.
        return failed_reply(msg, err, evaluation)


def _train(msg: Message, context: Context, evaluation: EvaluateReply | Exception | None = None) -> Message:
    t0 = time.time()
    cfg, spec, client, arrays, config, where = _setup(context, msg.content, training=True)
    instruction = TrainInstruction.from_config(config)
    release = privacy_floor.guard(client.node, context.state, cfg, instruction)
    reply = client.train(arrays, instruction)
    if release is not None:  # the node's own account of what this reply releases, checked again
        spent = privacy_floor.record(client.node, context.state, cfg, release)
        if release.limited:
            reply = reply.with_metrics({NODE_EPSILON: spent})
    if client.canaries is not None:
        reply = reply.with_metrics(finish_round(cfg, client.canaries, context.state))
    # Everything this node spent on the message (setup included): the rest of a round's
    # wall time is Flower/Ray/network overhead.
    reply = reply.with_metrics({COMPUTE_SECONDS: time.time() - t0})
    # The server names what it expects back this round (none named = nothing may leave):
    # the guard holds the reply to that as well as to the method's shared set.
    # What may leave this node: the method's sharing rule over the tensors its model has
    # (a LoRA adapter's names are known only where the model is loaded).
    allowed = spec.shares(cfg, client.tensor_names)
    persist(context.state, where, instruction.server_round)
    return guarded_reply(
        msg, reply, allowed=allowed, private=client.private, requested=instruction.reply_keys, evaluation=evaluation
    )


def evaluate(msg: Message, context: Context) -> Message:
    return guarded_reply(msg, _evaluation(context, msg.content, CONFIG_RECORD, ARRAYS_RECORD), allowed=frozenset())


HANDLERS = {MessageType.QUERY: hello, MessageType.TRAIN: train, MessageType.EVALUATE: evaluate}


def handle(msg: Message, context: Context) -> Message:
    return HANDLERS[msg.metadata.message_type](msg, context)
