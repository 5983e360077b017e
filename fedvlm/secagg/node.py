"""One node's part of a round of secure aggregation: its secrets, and the checks it makes before
it lets anything of them go.

The node draws two key pairs (one to agree encryption keys with its neighbours, one to agree
pairwise mask seeds) and a self-mask seed b, deals Shamir shares of b and of its mask key to
its neighbours (t of them rebuild either), and sends ``x + PRG(b) + sum_j +-PRG(s_ij)`` modulo
2^bits with its shares, masked with every neighbour of the round's graph: a neighbour that then
never deals has its pairwise mask removed with the seed the node itself reveals for it, once the
story is signed (``reveal``). Everything secret comes from the operating system's generator, whatever the run's noise
source: a seeded mask would hide nothing.

What binds a round together, so that a server that deviates learns no more than one that
follows the protocol (docs/privacy.md, "What the server learns"):
- one plan (``stages.SumPlan``): every node signs the plan's digest into its advert with its
  member's identity key (``secagg.roster``) and refuses adverts that carry another digest, no
  rostered member's signature, or a member twice. The server cannot hand nodes different plans
  (thresholds, noise shares, participants) and have them meet, nor make up members;
- one graph: derived from the round's session (the plan's digest and every accepted advert,
  ``session``), which no single party chooses; every node recomputes it from all the adverts it
  is shown, and the session enters every pairwise mask, so nodes shown different adverts produce
  masks that do not cancel;
- one story: before it reveals a share, a node signs the dealers (U2) and survivors (U3) it was
  told, and reveals only once a strict majority of the round's participants, and t of its own
  neighbourhood, signed the same story. Honest nodes sign one story each, so two stories cannot
  both gather a majority: every node that reveals answers the same story;
- the threshold: a strict majority of each node's share holders (2t > k + 1), at least two, at
  least the node's own floor and the survivors the noise was planned for.

Under these, the masks that no honest node helps remove cover every sum of fewer than t of the
survivors (docs/privacy.md gives the argument); the server learns the sum over the survivors, of
at least t nodes, one connected piece of the graph.

A share whose ciphertext does not decrypt, or was meant for another node, is kept out and
reported (``complaints``); the pairwise mask with its dealer was added all the same, since it
depends only on the dealer's public key, so the server's sum stays consistent.

Why a pairwise seed may be revealed: the node reveals its seed with neighbour j only for a j the
signed story says never dealt (U1 minus U2). The server then has j's pairwise masks with the
nodes that reveal, which a rebuilt mask key of j would give it too (Bell et al.'s own recovery of a
dropped node), and never j's self-mask: j dealt no share of it that a node accepted, and no node
reveals a seed share of a node outside the story's survivors. A quorum signs one story, so no node
reveals j's seed share under a story that counts j in. A survivor's own masks with the nodes that
stay in the sum are untouched: its update stays hidden by the masks it shares with them.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from fedvlm.errors import PublicError
from fedvlm.secagg import shamir
from fedvlm.secagg.graph import connected, degree, neighbours
from fedvlm.secagg.masks import SEED_BYTES, expand, modulus, reduce
from fedvlm.secagg.roster import Identity, Roster, verify
from fedvlm.secagg.stages import Advert, SumPlan

DH_BYTES = 32  # an X25519 key, private or public, raw
X25519_P = 2**255 - 19  # a public key's canonical encoding is below it (top bit clear)
ADVERT_DOMAIN = b"fedvlm secure aggregation advert v3"
SESSION_DOMAIN = b"fedvlm secure aggregation session v3"
STORY_DOMAIN = b"fedvlm secure aggregation story v3"
PAIR_DOMAIN = b"fedvlm secure aggregation pairwise mask v3"
SHARE_DOMAIN = b"fedvlm secure aggregation share encryption v3"
# what a prekey's signature covers in place of a plan's digest: a prekey is made before its round's plan
PREKEYED = hashlib.sha256(b"fedvlm secure aggregation prekey v1").digest()


class SecAggRefused(PublicError, RuntimeError):
    """The node will not take this step of the protocol; the message says why (built from the
    plan and the protocol's messages only, never from the node's data)."""


# ---- what the round's parties sign and hash (shared with secagg.server) ------------------------
def _framed(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def _node(node: int) -> bytes:
    return int(node).to_bytes(8, "big")


def advert_message(plan_digest: bytes, node: int, encryption: bytes, mask: bytes) -> bytes:
    """What a node's identity key signs of its advert."""
    return hashlib.sha256(ADVERT_DOMAIN + _framed(plan_digest, _node(node), encryption, mask)).digest()


@dataclass(frozen=True)
class Prekey:
    """A node's keys for the next secure round it takes part in, made and signed (over
    ``PREKEYED``, not a plan) before that round exists, and sent with its train reply. A round
    whose every participant has one on file needs no keys stage: its train message carries them
    (U1) and the node deals its shares in its train reply, four exchanges instead of five.

    Why the guarantees still hold (docs/privacy.md, "Keys made a round ahead"): a node uses a
    prekey in one session at most (``client_app.secure_aggregation`` takes it out of the node's
    state before the round's first step, and never signs another), so each of its secrets is
    dealt in one session, readable only there (a share's key is derived from the session, which
    names the plan); every node that can reveal a share of it answers a story of that session,
    whose quorum is over that one plan's participants, as with keys signed over the plan."""

    encryption_key: bytes
    mask_key: bytes
    advert: Advert

    @classmethod
    def new(cls, node_id: int, identity: Identity, over: bytes = PREKEYED) -> Prekey:
        """Two fresh key pairs, their advert signed by ``identity`` over ``over``: ``PREKEYED``
        for a prekey, a plan's digest for keys made in their round (``NodeRound.start``)."""
        (enc_sk, enc), (mask_sk, mask) = new_key(), new_key()
        signature = identity.sign(advert_message(over, node_id, enc, mask))
        return cls(enc_sk, mask_sk, Advert(enc, mask, identity.public, signature))

    def to_config(self) -> dict[str, bytes]:
        a = self.advert
        return {
            "encryption_key": self.encryption_key,
            "mask_key": self.mask_key,
            "encryption": a.encryption,
            "mask": a.mask,
            "identity": a.identity,
            "signature": a.signature,
        }

    @classmethod
    def from_config(cls, d: Mapping) -> Prekey:
        advert = Advert(d["encryption"], d["mask"], d["identity"], d["signature"])
        return cls(d["encryption_key"], d["mask_key"], advert)


def session(plan_digest: bytes, adverts: Mapping[int, Advert]) -> bytes:
    """The round's session: the plan and every accepted advert. It orders the graph and keys
    every pairwise mask."""
    parts = [plan_digest]
    for node in sorted(adverts):
        a = adverts[node]
        parts += [_node(node), a.encryption, a.mask, a.identity]
    return hashlib.sha256(SESSION_DOMAIN + _framed(*parts)).digest()


def story_message(session_id: bytes, dealers: Iterable[int], survivors: Iterable[int]) -> bytes:
    """What a node signs in the consistency round: who dealt, who survived, in which session."""
    ids = [_node(n) for n in sorted(dealers)] + [b"|"] + [_node(n) for n in sorted(survivors)]
    return hashlib.sha256(STORY_DOMAIN + _framed(session_id, *ids)).digest()


def quorum(participants: int) -> int:
    """The signatures a story needs: a strict majority of the round's participants, so that no
    two stories both gather one from honest nodes (each signs once)."""
    return participants // 2 + 1


def seed_commitment(seed: bytes) -> bytes:
    """What a node publishes of its self-mask seed, so that the server can tell a seed rebuilt
    from forged shares from the real one (SHA-256 of a uniform 256-bit secret hides it)."""
    return hashlib.sha256(b"fedvlm secure aggregation seed" + seed).digest()


def new_key() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair, raw: (private, public). X25519 rather than Flower's P-384: the
    protocol makes two agreements per pair of neighbours, and at 20 nodes P-384's were most of a
    round's protocol cost once Shamir sharing was cheap (``bench.secure_aggregation protocol``)."""
    private = X25519PrivateKey.generate()
    return private.private_bytes_raw(), private.public_key().public_bytes_raw()


def public_of(private: bytes) -> bytes:
    """The public key of a raw private key (``ValueError`` if it is not one)."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def agree(own_private: bytes, peer_public: bytes) -> bytes:
    """The X25519 shared secret; ``ValueError`` for a peer key that is not 32 bytes or of small
    order (the secret would be all zeros, known to anyone)."""
    return X25519PrivateKey.from_private_bytes(own_private).exchange(X25519PublicKey.from_public_bytes(peer_public))


def usable_key(key: object) -> bool:
    """Whether ``key`` is an X25519 public key a node can agree a secret with, in the one encoding
    of its point: X25519 ignores the top bit and reduces values of p = 2^255 - 19 and above, so
    without this a member could advertise another's key under other bytes, past the check that
    no two advertised keys are equal."""
    return (
        isinstance(key, bytes)
        and len(key) == DH_BYTES
        and int.from_bytes(key, "little") < X25519_P
        and _full_order(key)
    )


@functools.lru_cache(maxsize=1 << 12)
def _full_order(key: bytes) -> bool:
    """Whether agreeing with ``key`` gives a secret that is not all zeros (once per key in a
    process: in a simulation every node checks every advert)."""
    try:
        agree(X25519PrivateKey.generate().private_bytes_raw(), key)
    except ValueError:
        return False
    return True


def key_from_scalar(scalar: bytes) -> bytes:
    """The private key a node shared (its raw 32 bytes), checked to be one (``ValueError`` if it is none)."""
    public_of(scalar)
    return scalar


def _derived(secret: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def pair_seed(own_mask_key: bytes, peer_mask_public: bytes, session_id: bytes) -> bytes:
    """The seed two nodes share for their pairwise mask in ``session_id`` (X25519, then HKDF)."""
    return _derived(agree(own_mask_key, peer_mask_public), PAIR_DOMAIN + session_id, SEED_BYTES)


def pair_sign(node: int, peer: int) -> int:
    """+1 for the node with the larger id, -1 for the other: their masks cancel in the sum."""
    return 1 if node > peer else -1


def majority_threshold(holders: int) -> int:
    """The smallest strict majority of ``holders`` share holders."""
    return holders // 2 + 1


def check_threshold(threshold: int, holders: int) -> None:
    if not (2 * threshold > holders and threshold <= holders):
        raise SecAggRefused(
            f"threshold {threshold} for {holders} share holders: it must be a strict majority of them "
            f"(at least {majority_threshold(holders)}) and at most {holders}, or the server could collect "
            "both secrets of one node from two groups of holders"
        )


def check_plan(plan: SumPlan, node_id: int, roster: Roster, floor: int) -> None:
    """The node's terms for a round, before it trains: it is a participant, the plan names its
    roster, and the threshold is a strict majority of a node's share holders, at least two, at
    least ``floor`` (the node's ``secure-aggregation-min-clients``) and at least the survivors the
    noise is planned for."""
    n = len(plan.participants)
    if node_id not in plan.participants:
        raise SecAggRefused("the round's plan does not list this node among its participants")
    if plan.roster != roster.digest:
        raise SecAggRefused(
            f"the round's plan is for roster {plan.roster[:16] or '(none named)'}, this node pins roster "
            f"{roster.digest[:16]}: give the ServerApp the federation's roster (secure-aggregation.roster)"
        )
    try:
        modulus(plan.bits)
    except ValueError as why:
        raise SecAggRefused(str(why)) from None
    k = degree(plan.degree, n)
    if k < n - 1 and (k < 2 or k % 2):
        raise SecAggRefused(f"the plan's graph degree {plan.degree} is not an even number of at least 2")
    check_threshold(plan.threshold, k + 1)
    least = max(2, floor, plan.n_min if plan.client_sigma > 0 else 0)
    if plan.threshold < least:
        raise SecAggRefused(
            f"the round's threshold {plan.threshold} would let the server unmask a sum of {plan.threshold} node(s); "
            f"this node requires at least {least} (two, its secure-aggregation-min-clients {floor}, and the "
            f"{plan.n_min} survivors the noise is planned for)"
        )


@dataclass
class NodeRound:
    """A node's secrets and view of one round (kept on the node between the round's messages)."""

    node_id: int
    plan: SumPlan
    encryption_key: bytes = b""  # private keys, raw X25519
    mask_key: bytes = b""
    adverts: dict[int, Advert] = field(default_factory=dict)  # U1: node -> its signed advert
    session: bytes = b""
    seed: bytes = b""
    seed_shares: dict[int, bytes] = field(default_factory=dict)  # dealer -> this node's share of its seed
    key_shares: dict[int, bytes] = field(default_factory=dict)  # dealer -> this node's share of its mask key
    dealers: tuple[int, ...] = ()  # U2, as the server told it
    peers: tuple[int, ...] = ()  # the neighbours whose pairwise masks this node added: all of its graph's
    complaints: dict[int, str] = field(default_factory=dict)  # dealer -> why its share was kept out
    survivors: tuple[int, ...] = ()  # U3, as the server told it
    signature: bytes = b""  # this node's signature on its story
    stage: str = "keys"
    signed_over: bytes = b""  # what the round's adverts are signed over: PREKEYED, or (empty) the plan's digest

    # ---- stage 1: keys ------------------------------------------------------------------------
    @classmethod
    def start(
        cls, node_id: int, plan: SumPlan, roster: Roster, identity: Identity, floor: int = 0
    ) -> tuple[NodeRound, Advert]:
        """A fresh round under ``plan`` (checked: ``check_plan``), and the advert it sends: two
        public keys signed with the plan's digest by ``identity``, which must be on ``roster``."""
        keys = Prekey.new(node_id, identity, over=plan.digest)
        return cls.from_prekey(node_id, plan, roster, identity, keys, floor, signed_over=b""), keys.advert

    @classmethod
    def from_prekey(
        cls,
        node_id: int,
        plan: SumPlan,
        roster: Roster,
        identity: Identity,
        prekey: Prekey,
        floor: int = 0,
        signed_over: bytes = PREKEYED,
    ) -> NodeRound:
        """A round under ``plan`` (checked: ``check_plan``) keyed with ``prekey``, signed by
        ``identity`` (on ``roster``) over ``signed_over`` (empty: the plan's digest). A prekey
        made ahead (``Prekey``) must be out of the node's state already, so that it keys no other
        session."""
        check_plan(plan, node_id, roster, floor)
        if prekey.advert.identity != identity.public or roster.member(identity.public) is None:
            raise SecAggRefused("this node's identity key is not on the roster it pins, or its keys are another's")
        node = cls(node_id, plan, prekey.encryption_key, prekey.mask_key, signed_over=signed_over)
        node.adverts[node_id] = prekey.advert
        return node

    # ---- stage 2: shares, and the masked vector with them ----------------------------------------
    def share(self, adverts: Mapping[int, Advert], roster: Roster) -> tuple[bytes, dict[int, bytes]]:
        """The commitment to this node's self-mask seed, and its shares for each of its neighbours
        in the graph the round's adverts (U1, ``adverts``, all of them) determine, each encrypted
        to that neighbour. Every advert must be a participant's, signed over this plan by a
        distinct rostered member."""
        self._expect("keys")
        own = self.adverts[self.node_id]
        if adverts.get(self.node_id) != own:
            raise SecAggRefused("the server shows this node other public keys than the ones it advertised, or none")
        self._check_adverts(adverts, roster)
        if len(adverts) < self.plan.threshold:
            raise SecAggRefused(
                f"only {len(adverts)} nodes advertised keys, fewer than the threshold {self.plan.threshold}"
            )
        self.adverts = dict(adverts)
        self.session = session(self.plan.digest, adverts)
        mine = self.graph()[self.node_id]
        check_threshold(self.plan.threshold, len(mine) + 1)
        self.seed = os.urandom(SEED_BYTES)
        holders = sorted([self.node_id, *mine])
        seed_shares = shamir.split(self.seed, self.plan.threshold, len(holders))
        key_shares = shamir.split(self.mask_key, self.plan.threshold, len(holders))
        out = {}
        for holder, s_share, k_share in zip(holders, seed_shares, key_shares, strict=True):
            if holder == self.node_id:
                self.seed_shares[holder], self.key_shares[holder] = s_share, k_share
                continue
            secret = self._agreed(adverts[holder].encryption)
            out[holder] = encrypt(secret, share_keys_plaintext_concat(self.node_id, holder, s_share, k_share))
        self.stage = "shares"
        return seed_commitment(self.seed), out

    def _check_adverts(self, adverts: Mapping[int, Advert], roster: Roster) -> None:
        strangers = sorted(set(adverts) - set(self.plan.participants))
        if strangers:
            raise SecAggRefused(f"the server relays keys of nodes the plan does not list: {strangers}")
        members: dict[bytes, int] = {}
        for node, advert in sorted(adverts.items()):
            if roster.member(advert.identity) is None:
                raise SecAggRefused(f"node {node}'s keys are not signed by a member of this node's roster")
            if advert.identity in members:
                raise SecAggRefused(f"nodes {members[advert.identity]} and {node} speak for one member")
            members[advert.identity] = node
            signed = advert_message(self.signed_over or self.plan.digest, node, advert.encryption, advert.mask)
            if not verify(advert.identity, signed, advert.signature):
                raise SecAggRefused(
                    f"node {node}'s keys do not carry its member's signature over this round's plan"
                    + (" (or over its prekey)" if self.signed_over else "")
                )
            if not (usable_key(advert.encryption) and usable_key(advert.mask)):
                raise SecAggRefused(f"node {node}'s advertised key is not an X25519 public key of full order")
        keys = [k for a in adverts.values() for k in (a.encryption, a.mask)]
        if len(set(keys)) != len(keys):
            raise SecAggRefused("two advertised public keys are equal: one node impersonates another")

    def graph(self) -> dict[int, tuple[int, ...]]:
        """The round's graph, as every node that saw the same adverts derives it."""
        return neighbours(sorted(self.adverts), self.plan.degree, self.session)

    def mask(self, vector: np.ndarray) -> np.ndarray:
        """``vector`` (residues modulo 2^bits, uint64) plus this node's self mask and its pairwise
        masks with every neighbour of the round's graph, sent with its shares: who deals is not
        known yet, and a neighbour that never deals gets its mask removed with this node's own
        seed for it (``reveal``)."""
        self._expect("shares")
        self.peers = tuple(sorted(self.graph()[self.node_id]))
        v = np.asarray(vector, dtype=np.uint64)
        out = v + expand(self.seed, v.size, self.plan.bits)
        for peer in self.peers:
            out = (
                out + self._pair_mask(peer, v.size)
                if pair_sign(self.node_id, peer) > 0
                else out - self._pair_mask(peer, v.size)
            )
        self.stage = "masked"
        return reduce(out, self.plan.bits)

    def _pair_mask(self, peer: int, size: int) -> np.ndarray:
        return expand(self._pair_seed(peer), size, self.plan.bits)

    def _pair_seed(self, peer: int) -> bytes:
        return pair_seed(self.mask_key, self.adverts[peer].mask, self.session)

    # ---- stage 3: consistency -------------------------------------------------------------------
    def receive(self, dealers: Iterable[int], ciphertexts: Mapping[int, bytes]) -> None:
        """Keep the shares dealt to this node (``ciphertexts``: dealer -> ciphertext); ``dealers``:
        every node the server says dealt its shares (U2). The node must get one from each of its
        neighbours among them, and no other, and at least t - 1 of them."""
        self._expect("masked")
        dealers = tuple(sorted(set(dealers)))
        if not set(dealers) <= set(self.adverts) or self.node_id not in dealers:
            raise SecAggRefused("the server's dealers include nodes that advertised no keys, or leave this node out")
        mine = set(self.peers) & set(dealers)
        if set(ciphertexts) != mine:
            raise SecAggRefused(
                f"the server delivers shares from {sorted(ciphertexts)}, not from this node's neighbours among the "
                f"dealers {sorted(mine)}"
            )
        if len(mine) + 1 < self.plan.threshold:
            raise SecAggRefused(f"only {len(mine)} neighbours dealt shares: fewer than threshold - 1")
        for dealer, ciphertext in sorted(ciphertexts.items()):
            try:
                src, dst, s_share, k_share = share_keys_plaintext_separate(
                    decrypt(self._agreed(self.adverts[dealer].encryption), ciphertext)
                )
            except (InvalidToken, ValueError, TypeError):
                self.complaints[dealer] = "its ciphertext does not decrypt under the key agreed with it"
                continue
            if (src, dst) != (dealer, self.node_id):
                self.complaints[dealer] = f"its ciphertext carries a share from {src} meant for {dst}"
                continue
            self.seed_shares[dealer], self.key_shares[dealer] = s_share, k_share
        self.dealers = dealers
        self.stage = "dealt"

    def sign_story(self, survivors: Iterable[int], identity: Identity, floor: int = 0) -> bytes:
        """This node's signature on its story (the dealers it was told, and ``survivors``), once
        it checked that the survivors hold at least t of its own neighbourhood, are at least
        ``max(t, floor)`` and one connected piece of the graph. A node signs one story a round:
        asked again, it signs the same one and refuses any other."""
        self._expect("dealt", "signed")
        survivors = tuple(sorted(set(survivors)))
        if self.signature:
            if survivors != self.survivors:
                raise SecAggRefused("the server asks this node to sign another survivor set than the one it signed")
            return self.signature
        if not set(survivors) <= set(self.dealers) or self.node_id not in survivors:
            raise SecAggRefused("the survivors include nodes that did not deal shares, or leave this node out")
        alive = set(survivors) & {self.node_id, *self.peers}
        if len(alive) < self.plan.threshold:
            raise SecAggRefused(
                f"only {len(alive)} survivors among this node's neighbours and itself: fewer than the threshold "
                f"{self.plan.threshold}"
            )
        least = max(self.plan.threshold, floor)
        if len(survivors) < least:
            raise SecAggRefused(f"only {len(survivors)} survivors: this node helps unmask a sum of at least {least}")
        if not connected(self.graph(), survivors):
            raise SecAggRefused("the survivors are not one connected piece of the round's graph")
        self.survivors = survivors
        self.signature = identity.sign(self.story())
        self.stage = "signed"
        return self.signature

    def story(self) -> bytes:
        return story_message(self.session, self.dealers, self.survivors)

    # ---- stage 4: unmasking ---------------------------------------------------------------------
    def reveal(self, signatures: Mapping[int, bytes]) -> tuple[dict[int, bytes], dict[int, bytes], dict[int, bytes]]:
        """What the server needs to remove the masks: shares (dealer -> share) of each surviving
        neighbour's seed and its own, of the mask key of each neighbour that dealt and dropped, and
        this node's own pairwise seed with each neighbour that never dealt (neighbour -> seed);
        only once a strict majority of the participants (``quorum``) and t of this node's
        neighbourhood signed the story it signed (``signatures``: signer -> signature)."""
        self._expect("signed", "revealed")
        story = self.story()
        signed = {self.node_id} | {
            n for n, sig in signatures.items() if n in self.survivors and verify(self.adverts[n].identity, story, sig)
        }
        need = quorum(len(self.plan.participants))
        if len(signed) < need:
            raise SecAggRefused(
                f"{len(signed)} of the round's {len(self.plan.participants)} participants signed the survivors this "
                f"node signed: it reveals only once {need} have"
            )
        near = signed & {self.node_id, *self.graph()[self.node_id]}
        if len(near) < self.plan.threshold:
            raise SecAggRefused(
                f"{len(near)} of this node's neighbourhood signed its story: it reveals only once "
                f"{self.plan.threshold} have"
            )
        self.stage = "revealed"
        alive, gone = set(self.survivors), set(self.dealers) - set(self.survivors)
        own = {self.node_id, *self.peers}
        seeds = {n: self.seed_shares[n] for n in sorted(own & alive) if n in self.seed_shares}
        keys = {n: self.key_shares[n] for n in sorted(own & gone) if n in self.key_shares}
        pairs = {j: self._pair_seed(j) for j in self.peers if j not in self.dealers}
        return seeds, keys, pairs

    def _agreed(self, peer_public: bytes) -> bytes:
        """The key (Fernet's form) this node encrypts shares with, to and from a peer, in this
        round's session (X25519, then HKDF)."""
        secret = agree(self.encryption_key, peer_public)
        return base64.urlsafe_b64encode(_derived(secret, SHARE_DOMAIN + self.session, 32))

    def _expect(self, *stages: str) -> None:
        if self.stage not in stages:
            raise SecAggRefused(f"out of order: this node is at stage {self.stage!r}, not {' or '.join(stages)}")

    # ---- kept on the node between messages ------------------------------------------------------
    def to_bytes(self) -> bytes:
        d = {
            "node_id": self.node_id,
            "plan": self.plan.to_config(),
            "adverts": {
                str(n): [a.encryption.hex(), a.mask.hex(), a.identity.hex(), a.signature.hex()]
                for n, a in self.adverts.items()
            },  # fmt: skip
            "seed_shares": {str(k): v.hex() for k, v in self.seed_shares.items()},
            "key_shares": {str(k): v.hex() for k, v in self.key_shares.items()},
            "complaints": {str(k): v for k, v in self.complaints.items()},
            "dealers": list(self.dealers),
            "peers": list(self.peers),
            "survivors": list(self.survivors),
            "stage": self.stage,
        }
        for name in _BYTES:
            d[name] = getattr(self, name).hex()
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> NodeRound:
        d = json.loads(raw)
        return cls(
            node_id=d["node_id"],
            plan=SumPlan.from_config(d["plan"]),
            adverts={int(n): Advert(*(bytes.fromhex(x) for x in a)) for n, a in d["adverts"].items()},
            seed_shares={int(k): bytes.fromhex(v) for k, v in d["seed_shares"].items()},
            key_shares={int(k): bytes.fromhex(v) for k, v in d["key_shares"].items()},
            complaints={int(k): v for k, v in d["complaints"].items()},
            dealers=tuple(d["dealers"]),
            peers=tuple(d["peers"]),
            survivors=tuple(d["survivors"]),
            stage=d["stage"],
            **{name: bytes.fromhex(d[name]) for name in _BYTES},
        )


_BYTES = ("encryption_key", "mask_key", "session", "seed", "signature", "signed_over")
