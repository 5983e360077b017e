"""The four stages of a secure round on the wire, typed: what the server's message carries in its
``protocol.SECURE_SUM`` record at each stage, and what the node's reply carries back.

A round whose every participant sent a prekey with an earlier train reply (``secagg.node.Prekey``)
skips the second: its train message carries the plan and every participant's prekey (U1), and
the node's train reply its shares and its masked vector (``prekeyed_reply``); every train reply
carries the node's next prekey (``prekey_fields``).

1. ``keys``: the train message itself, plus the round's ``SumPlan`` (the participants, the graph's
   degree, the threshold, the vector's layout, encoding and noise, the roster's digest): one plan,
   the same for every node. The node trains, encodes its update (``secagg.summand``) and keeps
   it; its reply holds the training's metrics and its ``Advert``: two public keys signed, with
   the plan's digest and its node id, by its member's identity key (``secagg.roster``).
2. ``shares``: every advert the server accepted (U1); the node checks them all and derives the
   graph; the reply, its seed commitment, one ciphertext of shares per neighbour, and its masked
   vector (the one tensor of a secure round, ``SECAGG_MASKED``), masked with every neighbour.
3. ``consistency``: who dealt (U2), whose masked vectors are in the sum (U3), and the ciphertexts
   dealt to the node; the reply, the dealers whose shares it could not decrypt and the node's
   signature on that story.
4. ``unmask``: the signatures the server collected; the reply, the node's shares of the
   survivors' seeds and of the mask keys of the nodes that dealt and dropped, and its own pairwise
   seeds with the neighbours that never dealt.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fedvlm.errors import PublicError
from fedvlm.protocol import (
    SECAGG_BITS,
    SECAGG_CIPHERTEXTS,
    SECAGG_CLIENT_SIGMA,
    SECAGG_COMMITMENT,
    SECAGG_COMPLAINTS,
    SECAGG_DEALERS,
    SECAGG_DEGREE,
    SECAGG_ENCRYPTION_KEYS,
    SECAGG_GAMMA,
    SECAGG_IDENTITY_KEYS,
    SECAGG_KEY_OWNERS,
    SECAGG_KEY_SHARES,
    SECAGG_MASK_KEYS,
    SECAGG_N_MIN,
    SECAGG_NAMES,
    SECAGG_NODES,
    SECAGG_NORM_BOUND,
    SECAGG_PAIR_OWNERS,
    SECAGG_PAIR_SEEDS,
    SECAGG_PARTICIPANTS,
    SECAGG_PREKEY,
    SECAGG_ROSTER,
    SECAGG_ROUND,
    SECAGG_SEED_SHARES,
    SECAGG_SIGNATURES,
    SECAGG_SIZES,
    SECAGG_STAGE,
    SECAGG_SURVIVORS,
    SECAGG_THRESHOLD,
    SECAGG_WEIGHTED,
)

KEYS, SHARES, CONSISTENCY, UNMASK = "keys", "shares", "consistency", "unmask"
STAGES = (KEYS, SHARES, CONSISTENCY, UNMASK)
PLAN_DOMAIN = b"fedvlm secure aggregation plan v2"


class MalformedStage(PublicError, ValueError):
    """A stage's record lacks a field or holds one of the wrong type."""


def _ids(values: Any) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _list(values, str))
    except ValueError:
        raise MalformedStage("a node id is not a number") from None


def _texts(ids: Iterable[int]) -> list[str]:
    return [str(i) for i in ids]


def _list(values: Any, kind: type) -> list:
    if not isinstance(values, list) or any(not isinstance(v, kind) or isinstance(v, bool) for v in values):
        raise MalformedStage(f"expected a list of {kind.__name__}")
    return values


def _by_node(config: Mapping, key: str, nodes_key: str = SECAGG_NODES) -> dict[int, bytes]:
    nodes, values = _ids(config.get(nodes_key, [])), _list(config.get(key, []), bytes)
    if len(nodes) != len(values) or len(set(nodes)) != len(nodes):
        raise MalformedStage(f"{key} holds {len(values)} values for {len(nodes)} nodes, or names a node twice")
    return dict(zip(nodes, values, strict=True))


def stage_of(config: Mapping) -> str:
    stage = config.get(SECAGG_STAGE)
    if stage not in STAGES:
        raise MalformedStage(f"{SECAGG_STAGE} = {stage!r} is not one of {', '.join(STAGES)}")
    return str(stage)


@dataclass(frozen=True)
class SumPlan:
    """The round's secure sum, sent with the train message (stage ``keys``): one plan for every
    node of the round, which each node checks and whose digest it signs into its advert."""

    server_round: int
    participants: tuple[int, ...]  # every node sent the plan (U0), sorted
    degree: int  # neighbours per node as configured (0: every other; secagg.graph.degree)
    threshold: int
    bits: int
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    weighted: bool
    gamma: float
    norm_bound: float
    client_sigma: float  # 0: no noise is added to the sum
    n_min: int
    roster: str  # the digest of the roster the server relays for

    def to_config(self) -> dict:
        return {
            SECAGG_STAGE: KEYS,
            SECAGG_ROUND: self.server_round,
            SECAGG_PARTICIPANTS: _texts(self.participants),
            SECAGG_DEGREE: self.degree,
            SECAGG_THRESHOLD: self.threshold,
            SECAGG_BITS: self.bits,
            SECAGG_NAMES: list(self.names),
            SECAGG_SIZES: list(self.sizes),
            SECAGG_WEIGHTED: self.weighted,
            SECAGG_GAMMA: float(self.gamma),
            SECAGG_NORM_BOUND: float(self.norm_bound),
            SECAGG_CLIENT_SIGMA: float(self.client_sigma),
            SECAGG_N_MIN: self.n_min,
            SECAGG_ROSTER: self.roster,
        }

    @classmethod
    def from_config(cls, config: Mapping) -> SumPlan:
        try:
            plan = cls(
                _int(config[SECAGG_ROUND]),
                _ids(config[SECAGG_PARTICIPANTS]),
                _int(config[SECAGG_DEGREE]),
                _int(config[SECAGG_THRESHOLD]),
                _int(config[SECAGG_BITS]),
                tuple(_list(config[SECAGG_NAMES], str)),
                tuple(_list(config[SECAGG_SIZES], int)),
                bool(config[SECAGG_WEIGHTED]),
                _float(config[SECAGG_GAMMA]),
                _float(config[SECAGG_NORM_BOUND]),
                _float(config[SECAGG_CLIENT_SIGMA]),
                _int(config[SECAGG_N_MIN]),
                str(config[SECAGG_ROSTER]),
            )
        except KeyError as missing:
            raise MalformedStage(f"the round's secure-sum plan lacks {missing}") from None
        if list(plan.participants) != sorted(set(plan.participants)) or len(plan.names) != len(plan.sizes):
            raise MalformedStage("the plan's participants are not sorted and distinct, or its layout is uneven")
        return plan

    @property
    def digest(self) -> bytes:
        """What names this plan in every signature and mask of the round (SHA-256 of its fields)."""
        fields = {k: v for k, v in self.to_config().items() if k != SECAGG_STAGE}
        return hashlib.sha256(PLAN_DOMAIN + json.dumps(fields, sort_keys=True).encode()).digest()


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedStage(f"expected a whole number, got {type(value).__name__}")
    return value


def _float(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise MalformedStage("expected a finite number")
    return float(value)


@dataclass(frozen=True)
class Advert:
    """A node's public keys for one round, signed by its member's identity key
    (``secagg.node.advert_message``)."""

    encryption: bytes
    mask: bytes
    identity: bytes
    signature: bytes


def keys_reply(advert: Advert) -> dict:
    return {
        SECAGG_STAGE: KEYS,
        SECAGG_ENCRYPTION_KEYS: [advert.encryption],
        SECAGG_MASK_KEYS: [advert.mask],
        SECAGG_IDENTITY_KEYS: [advert.identity],
        SECAGG_SIGNATURES: [advert.signature],
    }


def read_keys_reply(config: Mapping) -> Advert:
    fields = [_list(config.get(k), bytes) for k in _ADVERT_KEYS]
    if any(len(f) != 1 for f in fields):
        raise MalformedStage("a keys reply holds one encryption key, one mask key, one identity key and a signature")
    return Advert(*(f[0] for f in fields))


_ADVERT_KEYS = (SECAGG_ENCRYPTION_KEYS, SECAGG_MASK_KEYS, SECAGG_IDENTITY_KEYS, SECAGG_SIGNATURES)


def prekey_fields(advert: Advert) -> dict:
    """A train reply's prekey: the node's keys for its next secure round."""
    return {SECAGG_PREKEY: [advert.encryption, advert.mask, advert.identity, advert.signature]}


def read_prekey(config: Mapping) -> Advert | None:
    """The prekey a train reply carries (None: none, or not four byte strings)."""
    try:
        fields = _list(config.get(SECAGG_PREKEY), bytes)
    except MalformedStage:
        return None
    return Advert(*fields) if len(fields) == 4 else None


def prekeyed_plan(plan: SumPlan, adverts: Mapping[int, Advert]) -> dict:
    """Stage ``keys`` of a round keyed with prekeys: the plan and every participant's prekey (U1)."""
    return {**peer_keys(adverts), **plan.to_config()}


def prekeyed_reply(commitment: bytes, ciphertexts: Mapping[int, bytes]) -> dict:
    """A node's train reply in a round keyed with prekeys: its shares, as a shares reply has them
    (its masked vector travels as the reply's tensor)."""
    return {**shares_reply(commitment, ciphertexts), SECAGG_STAGE: KEYS}


def after(stage: str, prekeyed: bool) -> str:
    """The stage that follows ``stage``: a round keyed with prekeys deals its shares with the training."""
    following = STAGES[STAGES.index(stage) + 1]
    return CONSISTENCY if prekeyed and following == SHARES else following


def peer_keys(adverts: Mapping[int, Advert]) -> dict:
    """Stage ``shares``: every accepted advert (U1), the node's own among them."""
    nodes = sorted(adverts)
    out: dict = {SECAGG_STAGE: SHARES, SECAGG_NODES: _texts(nodes)}
    for key, field in zip(_ADVERT_KEYS, ("encryption", "mask", "identity", "signature"), strict=True):
        out[key] = [getattr(adverts[n], field) for n in nodes]
    return out


def read_peer_keys(config: Mapping) -> dict[int, Advert]:
    fields = [_by_node(config, k) for k in _ADVERT_KEYS]
    return {n: Advert(*(f[n] for f in fields)) for n in fields[0]}


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


def story(dealers: Iterable[int], survivors: Iterable[int], ciphertexts: Mapping[int, bytes]) -> dict:
    """Stage ``consistency``: who dealt shares (U2), whose masked vectors are in the sum (U3), and
    the ciphertexts dealt to the node (dealer -> ciphertext)."""
    return {
        SECAGG_STAGE: CONSISTENCY,
        SECAGG_DEALERS: _texts(sorted(dealers)),
        SECAGG_SURVIVORS: _texts(sorted(survivors)),
        SECAGG_NODES: _texts(list(ciphertexts)),
        SECAGG_CIPHERTEXTS: list(ciphertexts.values()),
    }


def read_story(config: Mapping) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, bytes]]:
    return (
        _ids(config.get(SECAGG_DEALERS, [])),
        _ids(config.get(SECAGG_SURVIVORS, [])),
        _by_node(config, SECAGG_CIPHERTEXTS),
    )


def story_signature(signature: bytes, complaints: Iterable[int]) -> dict:
    return {SECAGG_STAGE: CONSISTENCY, SECAGG_SIGNATURES: [signature], SECAGG_COMPLAINTS: _texts(sorted(complaints))}


def read_story_signature(config: Mapping) -> tuple[bytes, list[int]]:
    """A consistency reply's signature and the dealers whose shares the node could not decrypt."""
    signatures = _list(config.get(SECAGG_SIGNATURES), bytes)
    if len(signatures) != 1:
        raise MalformedStage("a consistency reply holds one signature")
    return signatures[0], list(_ids(config.get(SECAGG_COMPLAINTS, [])))


def unmask(signatures: Mapping[int, bytes]) -> dict:
    """Stage ``unmask``: the survivors' signatures on the story (signer -> signature)."""
    return {SECAGG_STAGE: UNMASK, SECAGG_NODES: _texts(list(signatures)), SECAGG_SIGNATURES: list(signatures.values())}


def read_unmask(config: Mapping) -> dict[int, bytes]:
    return _by_node(config, SECAGG_SIGNATURES)


def shares_back(seeds: Mapping[int, bytes], keys: Mapping[int, bytes], pairs: Mapping[int, bytes]) -> dict:
    return {
        SECAGG_STAGE: UNMASK,
        SECAGG_NODES: _texts(list(seeds)),
        SECAGG_SEED_SHARES: list(seeds.values()),
        SECAGG_KEY_OWNERS: _texts(list(keys)),
        SECAGG_KEY_SHARES: list(keys.values()),
        SECAGG_PAIR_OWNERS: _texts(list(pairs)),
        SECAGG_PAIR_SEEDS: list(pairs.values()),
    }


def read_shares_back(config: Mapping) -> tuple[dict[int, bytes], dict[int, bytes], dict[int, bytes]]:
    return (
        _by_node(config, SECAGG_SEED_SHARES),
        _by_node(config, SECAGG_KEY_SHARES, SECAGG_KEY_OWNERS),
        _by_node(config, SECAGG_PAIR_SEEDS, SECAGG_PAIR_OWNERS),
    )
