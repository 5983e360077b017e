"""The honest-but-curious server's record (``attack.observe-uploads``): every round, what the
server sent each sampled client for training and what that client sent back, exactly as they
crossed the wire, written to ``<run dir>/uploads/round-NNNN.pt``.

The server sees these tensors in every run; it normally keeps only their aggregate. Under secure
aggregation what it sees of a client is its masked vector (``protocol.SECAGG_MASKED``), uniform
modulo 2^bits to whoever lacks the masks, and that is what is kept. A run that
keeps them lets ``python -m fedvlm.attacks`` play the server's membership attack
(``attacks.server``) on every upload of every round. Nothing here reaches a client, and a run
without the key writes nothing (``uploads/`` does not exist).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from fedvlm.protocol import ARRAYS_RECORD
from fedvlm.strategies.nodes import NodeInfo
from fedvlm.utils.files import atomic_torch_save

FOLDER = "uploads"


@dataclass
class RoundUploads:
    """One round as the server saw it, per client (by node name)."""

    round: int
    partition: dict[str, int]  # client -> partition id (-1: a node with its own data)
    sent: dict[str, dict[str, torch.Tensor]]  # what the client trained from
    uploaded: dict[str, dict[str, torch.Tensor]]  # what it sent back (error replies are absent)


def _arrays(msg: Message) -> dict[str, torch.Tensor]:
    record = msg.content[ARRAYS_RECORD] if ARRAYS_RECORD in msg.content else None
    if not isinstance(record, ArrayRecord):
        return {}
    return {k: torch.from_numpy(np.array(v.numpy())) for k, v in record.items()}


def record_round(
    run_dir: Path, server_round: int, sent: Iterable[Message], replies: Iterable[Message], nodes: Mapping[int, NodeInfo]
) -> None:
    """Write round ``server_round``'s train messages and replies (replies from unknown nodes and
    error replies carry nothing the server could use, and are left out)."""
    out = RoundUploads(server_round, {}, {}, {})
    for msg in sent:
        node = nodes.get(msg.metadata.dst_node_id)
        if node is not None:
            out.sent[node.name] = _arrays(msg)
            out.partition[node.name] = node.partition_id
    for reply in replies:
        node = nodes.get(reply.metadata.src_node_id)
        if node is not None and not reply.has_error() and node.name in out.sent:
            # every reply of the round (a secure round's four: only its masked vector is a tensor)
            out.uploaded.setdefault(node.name, {}).update(_arrays(reply))
    atomic_torch_save(out.__dict__, Path(run_dir) / FOLDER / f"round-{server_round:04d}.pt")


def load_rounds(run_dir: Path) -> list[RoundUploads]:
    """Every recorded round of a run, in order; raises if the run kept none."""
    folder = Path(run_dir) / FOLDER
    files = sorted(folder.glob("round-*.pt"))
    if not files:
        raise FileNotFoundError(
            f"{run_dir} holds no record of the clients' uploads ({folder}): run it with "
            '--run-config "attack.observe-uploads=true" for the server\'s attack'
        )
    return [RoundUploads(**torch.load(f, map_location="cpu", weights_only=False)) for f in files]
