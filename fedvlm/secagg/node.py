"""One node's part of a round of secure aggregation: its secrets, and the checks it makes before
it lets anything of them go.

The node draws two key pairs (one to agree encryption keys with its neighbours, one to agree
pairwise mask seeds) and a self-mask seed b, deals Shamir shares of b and of its mask key to
its neighbours (t of them reconstruct either), and sends ``x + PRG(b) + sum_j +-PRG(s_ij)``
modulo 2^bits. When the server says who survived, the node returns, for each neighbour, the
share of b (a survivor: its self mask must go) or of the mask key (a node that dropped out after
dealing its shares: its pairwise masks must go), never both for one neighbour. Everything
secret comes from the operating system's generator, whatever the run's noise source: a seeded
mask would hide nothing.

What the node refuses, and why:
- a threshold that is not a strict majority of the share holders (2t > k + 1): otherwise the
  server could tell two disjoint groups of holders different stories about one node (survived /
  dropped) and get both its secrets;
- fewer than t neighbours' keys, or keys that repeat: its shares could not be recovered, or a
  neighbour impersonates another;
- an unmasking request that names a node both survivor and dropped, names a node it holds no
  share of, leaves itself out of the survivors, names fewer than t survivors (the sum would then
  cover fewer clients, and less noise, than planned), or contradicts what it already revealed
  this round (a copy of the request asked again must ask the same).
A share whose ciphertext does not decrypt, or was meant for another node, is kept out and
reported (``complaints``); the pairwise mask with its dealer is added all the same, since it
depends only on the dealer's public key, so the server's sum stays consistent.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from fedvlm.secagg.masks import SEED_BYTES, expand, reduce

SCALAR_BYTES = 48  # a P-384 private scalar


class SecAggRefused(RuntimeError):
    """The node will not take this step of the protocol; the message says why."""


def seed_commitment(seed: bytes) -> bytes:
    """What a node publishes of its self-mask seed, so that the server can tell a seed rebuilt
    from forged shares from the real one (SHA-256 of a uniform 256-bit secret hides it)."""
    return hashlib.sha256(b"fedvlm secure aggregation seed" + seed).digest()


def key_scalar(private_pem: bytes) -> bytes:
    """A P-384 private key as its 48-byte scalar: what a node shares of its mask key (the PEM
    form is six times longer, and Shamir sharing costs per 16 bytes)."""
    key = bytes_to_private_key(private_pem)
    return key.private_numbers().private_value.to_bytes(SCALAR_BYTES, "big")


def key_from_scalar(scalar: bytes) -> bytes:
    """The private key (PEM) a 48-byte scalar stands for (``ValueError`` if it is none)."""
    return private_key_to_bytes(ec.derive_private_key(int.from_bytes(scalar, "big"), ec.SECP384R1()))


def pair_seed(own_mask_key: bytes, peer_mask_public: bytes) -> bytes:
    """The seed two nodes share for their pairwise mask (ECDH, then HKDF)."""
    return generate_shared_key(bytes_to_private_key(own_mask_key), bytes_to_public_key(peer_mask_public))


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


@dataclass
class NodeRound:
    """A node's secrets and view of one round (kept on the node between the round's messages)."""

    node_id: int
    server_round: int
    threshold: int
    neighbours: tuple[int, ...]
    bits: int
    encryption_key: bytes = b""  # private keys, PEM
    mask_key: bytes = b""
    adverts: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # node -> (encryption, mask) public keys
    seed: bytes = b""
    seed_shares: dict[int, bytes] = field(default_factory=dict)  # dealer -> this node's share of its seed
    key_shares: dict[int, bytes] = field(default_factory=dict)  # dealer -> this node's share of its mask key
    peers: tuple[int, ...] = ()  # the neighbours whose pairwise masks this node added
    complaints: dict[int, str] = field(default_factory=dict)  # dealer -> why its share was kept out
    revealed: dict[str, list[int]] = field(default_factory=dict)  # "seeds"/"keys" -> whose shares went out
    stage: str = "keys"

    # ---- stage 1: keys ------------------------------------------------------------------------
    @classmethod
    def start(
        cls, node_id: int, server_round: int, threshold: int, neighbours: list[int], bits: int
    ) -> tuple[NodeRound, tuple[bytes, bytes]]:
        """A fresh round, and the two public keys it advertises (encryption, mask)."""
        if node_id in neighbours or len(set(neighbours)) != len(neighbours):
            raise SecAggRefused("the server's neighbour list names this node itself, or a node twice")
        check_threshold(threshold, len(neighbours) + 1)
        enc_sk, enc_pk = generate_key_pairs()
        mask_sk, mask_pk = generate_key_pairs()
        node = cls(
            node_id,
            server_round,
            threshold,
            tuple(sorted(neighbours)),
            bits,
            private_key_to_bytes(enc_sk),
            private_key_to_bytes(mask_sk),
        )
        advert = (public_key_to_bytes(enc_pk), public_key_to_bytes(mask_pk))
        node.adverts[node_id] = advert
        return node, advert

    # ---- stage 2: shares ----------------------------------------------------------------------
    def share(self, adverts: dict[int, tuple[bytes, bytes]]) -> tuple[bytes, dict[int, bytes]]:
        """The commitment to this node's self-mask seed, and its shares for each neighbour that
        advertised keys (``adverts``), encrypted to that neighbour."""
        self._expect("keys")
        own = self.adverts[self.node_id]
        if adverts.get(self.node_id, own) != own:
            raise SecAggRefused("the server shows this node other public keys than the ones it advertised")
        peers = {n: a for n, a in adverts.items() if n != self.node_id}
        strangers = sorted(set(peers) - set(self.neighbours))
        if strangers:
            raise SecAggRefused(f"the server sends keys of nodes that are not this node's neighbours: {strangers}")
        if len(peers) + 1 < self.threshold:
            raise SecAggRefused(
                f"only {len(peers)} neighbours advertised keys: fewer than threshold - 1 = {self.threshold - 1}, so "
                "this node's secrets could not be recovered if it dropped out"
            )
        keys = [k for pair in [own, *peers.values()] for k in pair]
        if len(set(keys)) != len(keys):
            raise SecAggRefused("two advertised public keys are equal: one node impersonates another")
        for node, (enc, mask) in peers.items():
            try:
                bytes_to_public_key(enc), bytes_to_public_key(mask)
            except (ValueError, TypeError) as why:
                raise SecAggRefused(f"node {node}'s advertised key is not a public key: {why}") from None
        self.adverts.update(peers)
        self.seed = os.urandom(SEED_BYTES)
        holders = sorted([self.node_id, *peers])
        seed_shares = create_shares(self.seed, self.threshold, len(holders))
        key_shares = create_shares(key_scalar(self.mask_key), self.threshold, len(holders))
        out = {}
        for holder, s_share, k_share in zip(holders, seed_shares, key_shares, strict=True):
            if holder == self.node_id:
                self.seed_shares[holder], self.key_shares[holder] = s_share, k_share
                continue
            secret = generate_shared_key(
                bytes_to_private_key(self.encryption_key), bytes_to_public_key(peers[holder][0])
            )
            out[holder] = encrypt(secret, share_keys_plaintext_concat(self.node_id, holder, s_share, k_share))
        self.stage = "shares"
        return seed_commitment(self.seed), out

    # ---- stage 3: the masked vector -----------------------------------------------------------
    def receive(self, ciphertexts: dict[int, bytes]) -> None:
        """Keep the shares dealt to this node by the neighbours the server names as having dealt
        (``ciphertexts``: dealer -> ciphertext); those neighbours' pairwise masks will be added."""
        self._expect("shares")
        strangers = sorted((set(ciphertexts) - set(self.adverts)) | ({self.node_id} & set(ciphertexts)))
        if strangers:
            raise SecAggRefused(f"shares came from nodes that advertised no keys to this node: {strangers}")
        if len(ciphertexts) + 1 < self.threshold:
            raise SecAggRefused(
                f"only {len(ciphertexts)} neighbours dealt shares: fewer than threshold - 1 = {self.threshold - 1}"
            )
        for dealer, ciphertext in sorted(ciphertexts.items()):
            secret = self._agreed(self.adverts[dealer][0])
            try:
                src, dst, s_share, k_share = share_keys_plaintext_separate(decrypt(secret, ciphertext))
            except (InvalidToken, ValueError, TypeError):
                self.complaints[dealer] = "its ciphertext does not decrypt under the key agreed with it"
                continue
            if (src, dst) != (dealer, self.node_id):
                self.complaints[dealer] = f"its ciphertext carries a share from {src} meant for {dst}"
                continue
            self.seed_shares[dealer], self.key_shares[dealer] = s_share, k_share
        self.peers = tuple(sorted(ciphertexts))
        self.stage = "dealt"

    def mask(self, vector: np.ndarray) -> np.ndarray:
        """``vector`` (residues modulo 2^bits, uint64) plus this node's self mask and its pairwise
        masks with every neighbour that dealt shares."""
        self._expect("dealt")
        v = np.asarray(vector, dtype=np.uint64)
        out = v + expand(self.seed, v.size, self.bits)
        for peer in self.peers:
            m = expand(pair_seed(self.mask_key, self.adverts[peer][1]), v.size, self.bits)
            out = out + m if pair_sign(self.node_id, peer) > 0 else out - m
        self.stage = "masked"
        return reduce(out, self.bits)

    # ---- stage 4: unmasking -------------------------------------------------------------------
    def reveal(self, survivors: list[int], dropped: list[int]) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """The shares the server needs to remove the masks: of each survivor's seed, of each
        dropped node's mask key (both as dealer -> share)."""
        self._expect("masked", "revealed")
        alive, gone = set(survivors), set(dropped)
        known = set(self.peers) | {self.node_id}
        if alive & gone:
            raise SecAggRefused(f"the server names nodes both survivor and dropped: {sorted(alive & gone)}")
        if not (alive | gone) <= known:
            raise SecAggRefused(
                f"the server names nodes that dealt this node no share: {sorted((alive | gone) - known)}"
            )
        if self.node_id not in alive:
            raise SecAggRefused("the server lists this node, which sent its masked vector, as not surviving")
        if len(alive) < self.threshold:
            raise SecAggRefused(
                f"only {len(alive)} survivors among this node's neighbours and itself: fewer than the threshold "
                f"{self.threshold} the round's noise was planned for"
            )
        before = {k: set(v) for k, v in self.revealed.items()}
        if before and (before["seeds"] & gone or before["keys"] & alive):
            raise SecAggRefused("the server asks again with survivors and dropped nodes swapped")
        self.revealed = {
            "seeds": sorted(alive | before.get("seeds", set())),
            "keys": sorted(gone | before.get("keys", set())),
        }
        self.stage = "revealed"
        seeds = {n: self.seed_shares[n] for n in sorted(alive) if n in self.seed_shares}
        keys = {n: self.key_shares[n] for n in sorted(gone) if n in self.key_shares}
        return seeds, keys

    def _agreed(self, peer_public: bytes) -> bytes:
        """The encryption key this node shares with a peer (ECDH, then HKDF)."""
        return generate_shared_key(bytes_to_private_key(self.encryption_key), bytes_to_public_key(peer_public))

    def _expect(self, *stages: str) -> None:
        if self.stage not in stages:
            raise SecAggRefused(f"out of order: this node is at stage {self.stage!r}, not {' or '.join(stages)}")

    # ---- kept on the node between messages ------------------------------------------------------
    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["adverts"] = {str(k): [a.hex(), b.hex()] for k, (a, b) in self.adverts.items()}
        for name in ("seed_shares", "key_shares"):
            d[name] = {str(k): v.hex() for k, v in d[name].items()}
        for name in ("encryption_key", "mask_key", "seed"):
            d[name] = d[name].hex()
        d["complaints"] = {str(k): v for k, v in self.complaints.items()}
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> NodeRound:
        d = json.loads(raw)
        d["adverts"] = {int(k): (bytes.fromhex(a), bytes.fromhex(b)) for k, (a, b) in d["adverts"].items()}
        for name in ("seed_shares", "key_shares"):
            d[name] = {int(k): bytes.fromhex(v) for k, v in d[name].items()}
        for name in ("encryption_key", "mask_key", "seed"):
            d[name] = bytes.fromhex(d[name])
        d["complaints"] = {int(k): v for k, v in d["complaints"].items()}
        d["neighbours"], d["peers"] = tuple(d["neighbours"]), tuple(d["peers"])
        return cls(**d)
