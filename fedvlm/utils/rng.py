"""Every random draw of a run, named in one place.

A seeded draw's generator is keyed by a list of integers: ``[seed, SERVER, round, stream,
*extra]`` for the server's draws, ``[seed, NODE, round, node_seed, stream]`` for a node's
(round 0 for a draw made once per node, at first contact). The domain tag keeps a server key
from ever equalling a node key, and each stream below has one fixed key length, so two draws
share randomness only if they are the same draw. A stream number never changes: it is part of
every key, so renumbering one changes every seeded run's numbers (which the regression fixture
``tests/fixtures/regression.json`` would catch).

Whether a DP draw is seeded at all is decided elsewhere (``privacy.mechanisms``: with
``privacy.noise-source = 'os'`` noise and batch sampling ignore the key and come from the OS).
"""

from __future__ import annotations

import hashlib
from enum import IntEnum, unique

import numpy as np
import torch


@unique
class ServerStream(IntEnum):
    """The server's draws."""

    TRAIN_SAMPLE = 0  # which nodes train this round
    EVALUATE_SAMPLE = 1  # which nodes evaluate this round
    FEDRAND_HALF = 11  # FedRand's A-or-B draw; extra = the node's name key
    PFEDMOAP_EXPERTS = 12  # pFedMoAP's random expert selection; extra = the node's key
    GLOBAL_NOISE = 21  # the server's global-DP noise
    SECAGG_GRAPH = 31  # secure aggregation's graph of who shares secrets with whom


@unique
class NodeStream(IntEnum):
    """A node's draws."""

    LOCAL_NOISE = 1  # local-DP noise on the node's gradients
    POWER_ITERATION = 2  # DP-FPL's random start of each step's rank-k factorisation
    ABLATION_FACTOR = 3  # DP-FPL's no-residual ablation: the factorisation it evaluates
    LORA_DROPOUT = 4  # LoRA dropout masks
    BATCHES = 5  # which records form each local batch (Poisson or shuffled)
    SECURE_SUM = 6  # the rounding and noise share of the node's secure-aggregation vector
    LOCAL_INIT = 11  # once per node: the private local prompt
    PGP_FACTOR_INIT = 12  # once per node: FedPGP's factorisation of that prompt
    GATE_INIT = 13  # once per node: pFedMoAP's attention gate, at its first round with experts


def name_key(name: str) -> int:
    """A 63-bit integer that stands for a node name in a key (all of the name counts)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % (2**63)


def node_seed(partition_id: int, name: str) -> int:
    """The integer that stands for a node in its keys: ``partition_id + 1`` for a partition
    of the run's dataset (so a simulation's numbers do not depend on how Flower names nodes),
    else the node's name key (a node with its own data folder has no partition)."""
    return partition_id + 1 if partition_id >= 0 else name_key(name)


SERVER, NODE = 0, 1  # key domains


def server_key(seed: int, server_round: int, stream: ServerStream, *extra: int) -> list[int]:
    return [int(seed), SERVER, int(server_round), int(stream), *(int(e) for e in extra)]


def node_key(seed: int, node: int, stream: NodeStream, server_round: int = 0) -> list[int]:
    """A node's key; ``server_round`` 0 (no round) for a draw made once per node."""
    return [int(seed), NODE, int(server_round), int(node), int(stream)]


def generator_for(key: list[int]) -> torch.Generator:
    """A torch generator seeded from ``key`` through numpy's SeedSequence (which mixes every
    integer of the key into the state)."""
    seed = int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0] % (2**63))
    return torch.Generator().manual_seed(seed)


def numpy_rng(key: list[int]) -> np.random.Generator:
    return np.random.default_rng(key)
