"""A round's messages between the strategy's ``configure_*`` hooks and the grid: one message per
node (``bundle``: a node sampled for both this round's training and the previous round's
evaluation gets one message carrying both), and copies of the late ones (``ask_again``, which
``server_app.exchange.Exchanger`` calls). Both work on the run's parts (``strategies.parts``):
the round plans record what was sent, the budget decides what a copy costs.

A stage of a round is one ``Exchanger.run`` of such messages; a round with more stages (the
secure aggregation's key exchange, its masked upload, its unmasking) runs them one after the
other over the same parts, each stage's messages built by its hook and recorded in the round's
plan.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedvlm.protocol import (
    ARRAYS_RECORD,
    ATTEMPT,
    CONFIG_RECORD,
    EVALUATE_ARRAYS,
    EVALUATE_CONFIG,
    SECURE_SUM,
    SERVER_ROUND,
)
from fedvlm.secagg.stages import KEYS, stage_of
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.validation import record_nbytes


def bundle(parts: RunParts, train: list[Message], evaluation: list[Message]) -> list[Message]:
    """One exchange's messages, one per node: this round's ``train`` messages and the
    previous round's ``evaluation`` messages (both as ``configure_*`` returned them). A node
    in both gets its evaluation inside its train message (``protocol.EVALUATE_CONFIG``; the
    arrays too, as ``EVALUATE_ARRAYS``, only where they differ from the training's), and the
    evaluation's plan keeps that message as the one it sent the node.

    Why nothing changes for the node: it runs the evaluation first, with the state it would
    have had for an evaluate message of its own (nothing happens to its state between the two
    messages), and on the arrays that message would have carried. Why nothing changes for the
    server: the evaluation's figures come back in their own record and are validated and
    aggregated by ``aggregate_evaluate`` of their round; a reply that fails fails both."""
    if not train or not evaluation:
        return train + evaluation
    hosts = {m.metadata.dst_node_id: m for m in train}
    alone = []
    for msg in evaluation:
        host = hosts.get(msg.metadata.dst_node_id)
        if host is None:
            alone.append(msg)
            continue
        config = msg.content[CONFIG_RECORD]
        assert isinstance(config, ConfigRecord)  # _phase sends one
        kept = parts.plans[int(config[SERVER_ROUND])].phase("evaluate")  # type: ignore[arg-type]  # written by _phase
        host.content[EVALUATE_CONFIG] = config
        arrays, shared = msg.content[ARRAYS_RECORD], host.content[ARRAYS_RECORD]
        assert isinstance(arrays, ArrayRecord) and isinstance(shared, ArrayRecord)  # _phase sends them
        if _same_arrays(arrays, shared):  # nothing more to send: the node evaluates the train message's
            nbytes = record_nbytes({k: v.numpy() for k, v in arrays.items()})
            kept.bytes_down -= nbytes
            kept.client(parts.registry.nodes[host.metadata.dst_node_id].name)["evaluate/bytes_down"] = 0
        else:
            host.content[EVALUATE_ARRAYS] = arrays
        kept.messages = [host if m is msg else m for m in kept.messages]
    return train + alone


def ask_again(parts: RunParts, late: list[Message]) -> list[Message]:
    """Copies of the messages whose replies are late (``server_app.exchange``), to send once
    more; a message left out is not asked again, and why is recorded in the round.

    Why the accounting still holds: the budget spends a round for each trainee when its
    train message is sent (``RunBudget.charge_round``), because a lost reply may still have been
    computed and seen. A copy of a train message makes the node compute again. With the
    node's and the server's noise seeded, the node restores its state of the round before
    and releases the same tensors again: nothing is charged, as for a resumed round. With
    OS noise anywhere it is a second, independent release: the node's round is spent again,
    and the copy is not sent if that would take its records past the epsilon the run
    promised, counting the rounds still to come (``RunBudget.charge_replay``). Only one
    reply per node enters the aggregate (the exchange pulls the first to come), so the
    server's noise is added once."""
    copies = []
    sources = parts.registry.noise_sources()  # nodes may have joined since the round was sent
    for msg in late:
        node = parts.registry.nodes.get(msg.metadata.dst_node_id)
        if node is None:
            continue
        config = msg.content[CONFIG_RECORD]
        assert isinstance(config, ConfigRecord)  # _phase sends one
        server_round = int(config[SERVER_ROUND])  # type: ignore[arg-type]  # written by _phase
        phase = "train" if msg.metadata.message_type == MessageType.TRAIN else "evaluate"
        kept = parts.plans[server_round].phase(phase)
        later = SECURE_SUM in msg.content and stage_of(msg.content[SECURE_SUM]) != KEYS  # a secure round's
        trains = phase == "train" and not later  # later stages run on what the node kept: no training
        charged, over = parts.budget.charge_replay(node.name, server_round, sources) if trains else (False, None)
        if over is not None:
            why = f"asking again would bring epsilon to {over:.4g}, past what the run promised"
            kept.asked_again.append({"client": node.name, "phase": phase, "asked": False, "why": why})
            continue
        content = RecordDict(dict(msg.content.items()))  # a bundled evaluation too
        content[CONFIG_RECORD] = ConfigRecord({**config, ATTEMPT: 2})
        copy = Message(content, dst_node_id=node.node_id, message_type=msg.metadata.message_type)
        copies.append(copy)
        asked = {"client": node.name, "phase": phase, "asked": True, "charged": charged}
        (kept.stage_messages if later else kept.messages).append(copy)
        kept.asked_again.append(asked)
        if EVALUATE_CONFIG in content:  # the evaluation it carries is asked again with it
            evaluated = parts.plans[int(content[EVALUATE_CONFIG][SERVER_ROUND])].phase("evaluate")  # type: ignore[arg-type]
            evaluated.messages.append(copy)
            evaluated.asked_again.append({**asked, "phase": "evaluate", "charged": False})
    return copies


def _same_arrays(a: ArrayRecord, b: ArrayRecord) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].data == b[k].data for k in a
    )
