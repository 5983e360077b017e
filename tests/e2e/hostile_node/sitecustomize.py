"""Makes the ClientApps of the machine whose PYTHONPATH holds this folder hostile: an
organisation controls its own node, so it can change what its ClientApp sends (the app the node
pinned protects the organisation from the server, not the server from the organisation).

``FEDVLM_HOSTILE=hello``: the handshake reports no training records.
``FEDVLM_HOSTILE=secure-dropout``: under secure aggregation the node drops out of round r at the
stage ``SECURE_DROPS`` names (keys, shares, keys again once keyed a round ahead, consistency, unmask),
answering that stage with an error.
``FEDVLM_HOSTILE=replies``: each train and evaluate reply is corrupted, one way per round (``CORRUPT``; in round 4 the
final evaluation's reply is an error with a 5 MB reason, ``FAIL``), and so is each evaluation that travels
with a train message. Python imports
``sitecustomize`` at start-up from the path, so every Flower process of that node loads it; only
ClientApp calls change.
"""

from __future__ import annotations

import os

import numpy as np


def _first(content) -> str:
    return sorted(content["arrays"].keys())[0]


def _header_kept(content, data: bytes, stype: str = "numpy.ndarray") -> None:
    """The first tensor with its honest header (float32, its shape) and ``data`` behind it."""
    from flwr.app import Array

    key = _first(content)
    honest = content["arrays"][key]
    content["arrays"][key] = Array(dtype="float32", shape=tuple(honest.shape), stype=stype, data=data)


def _npy(values: np.ndarray) -> bytes:
    from flwr.app import Array

    return Array(np.ascontiguousarray(values, dtype=np.float32)).data


def _set_metric(name: str, value: float):
    def corrupt(content, record: str = "metrics") -> None:
        content[record][name] = value

    return corrupt


def _made_up_tensors(content) -> None:
    """2,000 tensors the server never asked for, each under a long made-up name."""
    from flwr.app import Array

    for i in range(2000):
        content["arrays"][f"made-up-{i:04d}-" + "x" * 200] = Array(np.zeros(1, np.float32))


# (message type, server round) -> what is done to the honest reply's content (an evaluation's:
# to its metrics, also where it rode in a train message, whose reply holds them in "evaluation")
CORRUPT = {
    ("train", 1): lambda c: _header_kept(c, b"\x93JUNK" * 64),
    ("evaluate", 1): _set_metric("local-acc", 1e6),
    ("train", 2): _made_up_tensors,
    ("evaluate", 2): _set_metric("smuggled-bits", 3.0),
    ("train", 3): lambda c: _header_kept(c, _npy(np.ones(11))),
    ("evaluate", 3): _set_metric("local-acc", -0.5),
}
# (message type, server round) -> the error reply sent instead of the honest one
# (the final round's evaluation: a separate message; an earlier round's rides with the next train
# message, whose error reply would fail both)
FAIL = {("evaluate", 4): "RuntimeError: " + "a 5 MB reason " * 380_000}


# server round -> the secure-aggregation stage the node drops out at: round 1 before its advert, round
# 2 (keyed afresh: its round-1 train reply never came, so it has no prekey) before its shares and
# masked vector, round 3 (keyed with the prekey its round-2 train reply carried) before its train
# reply, which would carry them: in both its neighbours return their own pairwise seeds with it;
# then at the story and at the unmasking
SECURE_DROPS = {1: "keys", 2: "shares", 3: "keys", 4: "consistency", 5: "unmask"}


def _install(mode: str) -> None:
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    honest_call = ClientApp.__call__

    def hostile_call(self, message: Message, context):
        reply = honest_call(self, message, context)
        if reply.has_error():
            return reply
        kind = message.metadata.message_type
        if mode == "secure-dropout" and "secure-sum" in message.content:
            stage = message.content["secure-sum"]["secagg.stage"]
            if SECURE_DROPS.get(int(message.content["config"]["server-round"])) == stage:
                from flwr.app import Error

                return Message(Error(code=0, reason=f"dropped out at the {stage} stage"), reply_to=message)
        if mode == "replies" and kind in ("train", "evaluate"):
            reason = FAIL.get((kind, int(message.content["config"]["server-round"])))
            if reason is not None:
                from flwr.app import Error

                return Message(Error(code=0, reason=reason), reply_to=message)
        if mode == "hello" and kind == "query":
            reply.content["metrics"]["num-train"] = 0
        elif mode == "replies" and kind in ("train", "evaluate"):
            corrupt = CORRUPT.get((kind, int(message.content["config"]["server-round"])))
            if corrupt is not None:
                corrupt(reply.content)
            if kind == "train" and "evaluate-config" in message.content:  # the evaluation it carried
                carried = CORRUPT.get(("evaluate", int(message.content["evaluate-config"]["server-round"])))
                if carried is not None:
                    carried(reply.content, "evaluation")
        return reply

    ClientApp.__call__ = hostile_call


if os.environ.get("FEDVLM_HOSTILE"):
    _install(os.environ["FEDVLM_HOSTILE"])
