"""A node's later stages of a secure round (``fedvlm.secagg``: shares, the masked vector,
unmasking), and what the node decides for itself about secure aggregation. The first stage, which
trains, is ``client_app.secure_sum``; these run on what it kept (``secagg.node.NodeRound``, which
makes the protocol's checks), need neither the model nor torch, and so start fast in a ClientApp
process of their own (``client_app.app`` routes them here).

What the node decides for itself (node config):
- ``require-secure-aggregation = true``: a run without it is refused at the handshake;
- ``secure-aggregation-min-clients = N``: the node helps unmask only a sum of at least N
  survivors, and refuses a round whose threshold would let the server unmask fewer.

A message asked again (``server_app.messages.ask_again``) gets the answer the node gave the first
copy, if it asks the same; an unmasking request that asks something else is judged by
``NodeRound.reveal``, which refuses one that contradicts what the node already revealed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
from flwr.app import Context, Message

from fedvlm.client_app.send_guard import secure_reply
from fedvlm.client_app.state import load_secure, save_secure
from fedvlm.protocol import SECURE_SUM
from fedvlm.runconfig import ConfigError
from fedvlm.secagg import stages
from fedvlm.secagg.masks import wire_dtype
from fedvlm.secagg.node import NodeRound, SecAggRefused

REQUIRE = "require-secure-aggregation"  # node config keys
MIN_CLIENTS = "secure-aggregation-min-clients"
TRUE_WORDS = ("true", "1", "yes")
# what the node keeps of its secure round: its secrets, its encoded vector, the masked vector it
# sent, and (per stage) a digest of the request it answered
ROUND, VECTOR, MASKED, ASKED = "round", "vector", "masked", "asked"


def required(node_config: Mapping) -> bool:
    return str(node_config.get(REQUIRE, "")).strip().lower() in TRUE_WORDS


def min_clients(node_config: Mapping) -> int:
    return int(node_config.get(MIN_CLIENTS, 0) or 0)


def hello_check(node_config: Mapping, enabled: bool) -> None:
    """At the handshake: a node that requires secure aggregation refuses a run without it."""
    if required(node_config) and not enabled:
        raise ConfigError(
            f"this node requires secure aggregation ({REQUIRE} = true in its node config) and the run does not "
            "use it: set secure-aggregation.enabled = true in the run config"
        )


def is_later_stage(msg: Message) -> bool:
    """Whether ``msg`` is a secure round's shares, masked or unmask message (no training)."""
    return SECURE_SUM in msg.content and stages.stage_of(msg.content[SECURE_SUM]) != stages.KEYS


def next_stage(msg: Message, context: Context) -> Message:
    """Stages ``shares``, ``masked`` and ``unmask``, on what the node kept from its first stage."""
    config = dict(msg.content[SECURE_SUM])
    stage = stages.stage_of(config)
    held = load_secure(context.state)
    if ROUND not in held:
        raise SecAggRefused("this node holds no secure round in progress (it restarted, or never trained in it)")
    asked = hashlib.sha256(repr(sorted(config.items())).encode()).hexdigest()
    before = load_secure(context.state, f"/{stage}")
    if before.get(ASKED) == asked:  # a copy of a message already answered: the same answer
        return _reply(msg, stage, before, held)
    secure = NodeRound.from_bytes(held[ROUND])
    answer: dict
    if stage == stages.SHARES:
        answer = stages.shares_reply(*secure.share(stages.read_peer_keys(config)))
    elif stage == stages.MASKED:
        secure.receive(stages.read_dealt(config))
        masked = secure.mask(np.frombuffer(held[VECTOR], dtype=np.uint64))
        held[MASKED] = masked.astype(wire_dtype(secure.bits)).tobytes()
        answer = stages.masked_reply(secure.complaints)
    elif stage == stages.UNMASK:
        survivors, dropped = stages.read_unmask(config)
        floor = min_clients(context.node_config)
        if len(survivors) < floor:
            raise SecAggRefused(f"only {len(survivors)} survivors: this node's {MIN_CLIENTS} is {floor}")
        answer = stages.shares_back(*secure.reveal(survivors, dropped))
    else:
        raise SecAggRefused(f"stage {stage!r} comes with the train message, not on its own")
    held[ROUND] = secure.to_bytes()
    save_secure(context.state, held)
    save_secure(context.state, {**answer, ASKED: asked}, f"/{stage}")
    return _reply(msg, stage, answer, held)


def _reply(msg: Message, stage: str, answer: dict, held: dict) -> Message:
    bits = NodeRound.from_bytes(held[ROUND]).bits
    masked = np.frombuffer(held[MASKED], dtype=wire_dtype(bits)) if stage == stages.MASKED else None
    return secure_reply(msg, {}, {k: v for k, v in answer.items() if k != ASKED}, masked=masked)
