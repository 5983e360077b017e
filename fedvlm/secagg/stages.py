"""The four stages of a secure round on the wire, typed: what the server's message carries in its
``protocol.SECURE_SUM`` record at each stage, and what the node's reply carries back.

1. ``keys``: the train message itself, plus the round's ``SumPlan`` (the neighbours, the
   threshold, the vector's layout and encoding). The node trains, encodes its update
   (``secagg.summand``) and keeps it; its reply holds the training's metrics and two public keys,
   no tensor.
2. ``shares``: the neighbours' public keys; the reply, the node's seed commitment and one
   ciphertext of shares per neighbour.
3. ``masked``: the ciphertexts dealt to the node; the reply, its masked vector (the one tensor
   of a secure round, ``SECAGG_MASKED``) and the dealers whose shares it could not decrypt.
4. ``unmask``: who survived and who dropped among its neighbours; the reply, its shares of the
   survivors' seeds and of the dropped nodes' mask keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedvlm.protocol import (
    SECAGG_BITS,
    SECAGG_CIPHERTEXTS,
    SECAGG_CLIENT_SIGMA,
    SECAGG_COMMITMENT,
    SECAGG_COMPLAINTS,
    SECAGG_DROPPED,
    SECAGG_ENCRYPTION_KEYS,
    SECAGG_GAMMA,
    SECAGG_KEY_OWNERS,
    SECAGG_KEY_SHARES,
    SECAGG_MASK_KEYS,
    SECAGG_N_MIN,
    SECAGG_NAMES,
    SECAGG_NEIGHBOURS,
    SECAGG_NODES,
    SECAGG_NORM_BOUND,
    SECAGG_SEED_SHARES,
    SECAGG_SIZES,
    SECAGG_STAGE,
    SECAGG_SURVIVORS,
    SECAGG_THRESHOLD,
    SECAGG_WEIGHTED,
)

KEYS, SHARES, MASKED, UNMASK = "keys", "shares", "masked", "unmask"
STAGES = (KEYS, SHARES, MASKED, UNMASK)


class MalformedStage(ValueError):
    """A stage's record lacks a field or holds one of the wrong type."""


def _ids(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in _list(values, str))


def _texts(ids: Mapping[int, Any] | tuple[int, ...] | list[int]) -> list[str]:
    return [str(i) for i in ids]


def _list(values: Any, kind: type) -> list:
    if not isinstance(values, list) or any(not isinstance(v, kind) for v in values):
        raise MalformedStage(f"expected a list of {kind.__name__}")
    return values


def _by_node(config: Mapping, key: str) -> dict[int, bytes]:
    nodes, values = _ids(config.get(SECAGG_NODES, [])), _list(config.get(key, []), bytes)
    if len(nodes) != len(values):
        raise MalformedStage(f"{key} holds {len(values)} values for {len(nodes)} nodes")
    return dict(zip(nodes, values, strict=True))


def stage_of(config: Mapping) -> str:
    stage = config.get(SECAGG_STAGE)
    if stage not in STAGES:
        raise MalformedStage(f"{SECAGG_STAGE} = {stage!r} is not one of {', '.join(STAGES)}")
    return str(stage)


@dataclass(frozen=True)
class SumPlan:
    """The round's secure sum, sent with the train message (stage ``keys``)."""

    threshold: int
    neighbours: tuple[int, ...]
    bits: int
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    weighted: bool
    gamma: float
    norm_bound: float
    client_sigma: float  # 0: no noise is added to the sum
    n_min: int

    def to_config(self) -> dict:
        return {
            SECAGG_STAGE: KEYS,
            SECAGG_THRESHOLD: self.threshold,
            SECAGG_NEIGHBOURS: _texts(self.neighbours),
            SECAGG_BITS: self.bits,
            SECAGG_NAMES: list(self.names),
            SECAGG_SIZES: list(self.sizes),
            SECAGG_WEIGHTED: self.weighted,
            SECAGG_GAMMA: float(self.gamma),
            SECAGG_NORM_BOUND: float(self.norm_bound),
            SECAGG_CLIENT_SIGMA: float(self.client_sigma),
            SECAGG_N_MIN: self.n_min,
        }

    @classmethod
    def from_config(cls, config: Mapping) -> SumPlan:
        try:
            return cls(
                int(config[SECAGG_THRESHOLD]),
                _ids(config[SECAGG_NEIGHBOURS]),
                int(config[SECAGG_BITS]),
                tuple(_list(config[SECAGG_NAMES], str)),
                tuple(int(v) for v in _list(config[SECAGG_SIZES], int)),
                bool(config[SECAGG_WEIGHTED]),
                float(config[SECAGG_GAMMA]),
                float(config[SECAGG_NORM_BOUND]),
                float(config[SECAGG_CLIENT_SIGMA]),
                int(config[SECAGG_N_MIN]),
            )
        except KeyError as missing:
            raise MalformedStage(f"the round's secure-sum plan lacks {missing}") from None


def keys_reply(encryption: bytes, mask: bytes) -> dict:
    return {SECAGG_STAGE: KEYS, SECAGG_ENCRYPTION_KEYS: [encryption], SECAGG_MASK_KEYS: [mask]}


def read_keys_reply(config: Mapping) -> tuple[bytes, bytes]:
    enc, mask = _list(config.get(SECAGG_ENCRYPTION_KEYS), bytes), _list(config.get(SECAGG_MASK_KEYS), bytes)
    if len(enc) != 1 or len(mask) != 1:
        raise MalformedStage("a keys reply holds one encryption key and one mask key")
    return enc[0], mask[0]


def peer_keys(adverts: Mapping[int, tuple[bytes, bytes]]) -> dict:
    """Stage ``shares``: the neighbours' public keys (the node's own among them)."""
    return {
        SECAGG_STAGE: SHARES,
        SECAGG_NODES: _texts(list(adverts)),
        SECAGG_ENCRYPTION_KEYS: [a[0] for a in adverts.values()],
        SECAGG_MASK_KEYS: [a[1] for a in adverts.values()],
    }


def read_peer_keys(config: Mapping) -> dict[int, tuple[bytes, bytes]]:
    enc, mask = _by_node(config, SECAGG_ENCRYPTION_KEYS), _by_node(config, SECAGG_MASK_KEYS)
    return {n: (enc[n], mask[n]) for n in enc}


def shares_reply(commitment: bytes, ciphertexts: Mapping[int, bytes]) -> dict:
    return {
        SECAGG_STAGE: SHARES,
        SECAGG_COMMITMENT: commitment,
        SECAGG_NODES: _texts(list(ciphertexts)),
        SECAGG_CIPHERTEXTS: list(ciphertexts.values()),
    }


def read_shares_reply(config: Mapping) -> tuple[bytes, dict[int, bytes]]:
    commitment = config.get(SECAGG_COMMITMENT)
    if not isinstance(commitment, bytes):
        raise MalformedStage("a shares reply holds no seed commitment")
    return commitment, _by_node(config, SECAGG_CIPHERTEXTS)


def dealt(ciphertexts: Mapping[int, bytes]) -> dict:
    """Stage ``masked``: the ciphertexts dealt to the node (dealer -> ciphertext)."""
    return {
        SECAGG_STAGE: MASKED,
        SECAGG_NODES: _texts(list(ciphertexts)),
        SECAGG_CIPHERTEXTS: list(ciphertexts.values()),
    }


def read_dealt(config: Mapping) -> dict[int, bytes]:
    return _by_node(config, SECAGG_CIPHERTEXTS)


def masked_reply(complaints: Mapping[int, str]) -> dict:
    return {SECAGG_STAGE: MASKED, SECAGG_COMPLAINTS: _texts(sorted(complaints))}


def read_complaints(config: Mapping) -> list[int]:
    return list(_ids(config.get(SECAGG_COMPLAINTS, [])))


def unmask(survivors: list[int], dropped: list[int]) -> dict:
    """Stage ``unmask``: who survived and who dropped among the node's neighbours."""
    return {SECAGG_STAGE: UNMASK, SECAGG_SURVIVORS: _texts(survivors), SECAGG_DROPPED: _texts(dropped)}


def read_unmask(config: Mapping) -> tuple[list[int], list[int]]:
    return list(_ids(config.get(SECAGG_SURVIVORS, []))), list(_ids(config.get(SECAGG_DROPPED, [])))


def shares_back(seeds: Mapping[int, bytes], keys: Mapping[int, bytes]) -> dict:
    return {
        SECAGG_STAGE: UNMASK,
        SECAGG_NODES: _texts(list(seeds)),
        SECAGG_SEED_SHARES: list(seeds.values()),
        SECAGG_KEY_OWNERS: _texts(list(keys)),
        SECAGG_KEY_SHARES: list(keys.values()),
    }


def read_shares_back(config: Mapping) -> tuple[dict[int, bytes], dict[int, bytes]]:
    seeds = _by_node(config, SECAGG_SEED_SHARES)
    owners, values = _ids(config.get(SECAGG_KEY_OWNERS, [])), _list(config.get(SECAGG_KEY_SHARES, []), bytes)
    if len(owners) != len(values):
        raise MalformedStage(f"{len(values)} key shares for {len(owners)} nodes")
    return seeds, dict(zip(owners, values, strict=True))
