"""The server's side of a round of secure aggregation: route the nodes' keys and encrypted shares,
collect the masked vectors, and remove the masks from their sum with the shares the survivors
return. The server never holds what would unmask one node: a survivor's pairwise masks stay
(only their sum cancels), a dropped node's self mask stays (its vector is not in the sum).

Who takes part shrinks stage by stage (SecAgg+'s U1 ... U4): the nodes whose keys are well
formed; those that dealt a share to every neighbour; those that sent a well-formed masked
vector; those that returned shares. A node that sends something malformed (a key that is not
a public key, a key another node uses, a share list that skips a neighbour, a vector of the
wrong size or past the modulus) is excluded with the reason, as a dropout is, and the round
goes on while every remaining node keeps at least ``threshold - 1`` neighbours. A secret that
cannot be rebuilt to match what its owner published (the seed's commitment, the mask key's
public key) from the shares returned, even leaving forged shares out, fails the round
(``SecAggError``): no sum, rather than a wrong one.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key, public_key_to_bytes

from fedvlm.secagg.masks import expand, modulus, reduce
from fedvlm.secagg.node import check_threshold, key_from_scalar, pair_seed, pair_sign, seed_commitment

MAX_KEY_BYTES = 1024  # a PEM public key on P-384 is about 215 bytes
MAX_CIPHERTEXT_BYTES = 8192  # two shares of a few hundred bytes, encrypted
SEED, MASK_KEY = "seed", "mask key"  # the two secrets a node deals shares of
SUBSETS_TRIED = 64  # t-subsets of a secret's shares tried when the full set was forged


class SecAggError(RuntimeError):
    """The round's sum cannot be recovered; nothing of it is released."""


@dataclass
class ServerRound:
    """The server's view of one round (node ids are Flower's)."""

    server_round: int
    threshold: int
    bits: int
    size: int  # the length of every node's vector
    graph: dict[int, tuple[int, ...]]
    adverts: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # U1
    commitments: dict[int, bytes] = field(default_factory=dict)
    dealt: dict[int, dict[int, bytes]] = field(default_factory=dict)  # U2: dealer -> holder -> ciphertext
    masked: dict[int, np.ndarray] = field(default_factory=dict)  # U3
    revealers: list[int] = field(default_factory=list)  # U4
    excluded: dict[int, str] = field(default_factory=dict)  # node -> why it was left out
    forged: dict[int, str] = field(default_factory=dict)  # holder -> which of its returned shares did not fit
    complaints: dict[int, list[int]] = field(default_factory=dict)  # dealer -> holders that could not decrypt its share

    def __post_init__(self) -> None:
        modulus(self.bits)
        for peers in self.graph.values():
            check_threshold(self.threshold, len(peers) + 1)

    # ---- stage 1 -> 2 ---------------------------------------------------------------------------
    def take_adverts(self, replies: Mapping[int, tuple[bytes, bytes]]) -> dict[int, dict[int, tuple[bytes, bytes]]]:
        """Each remaining node's view for stage 2: its own and its neighbours' public keys."""
        for node, advert in replies.items():
            why = _advert_problem(advert) if node in self.graph else "it was not asked to take part"
            if why:
                self._exclude(node, why)
            else:
                self.adverts[node] = (bytes(advert[0]), bytes(advert[1]))
        owners: dict[bytes, set[int]] = {}
        for node, pair in self.adverts.items():
            for key in pair:
                owners.setdefault(key, set()).add(node)
        repeated = {n for node, pair in self.adverts.items() for n in owners[pair[0]] | owners[pair[1]] if n != node}
        repeated |= {node for node, pair in self.adverts.items() if pair[0] == pair[1]}
        for node in repeated:
            self._exclude(node, "it advertised a public key that another key of the round repeats")
            del self.adverts[node]
        self._prune(self.adverts, "advertised keys")
        return {u: {v: self.adverts[v] for v in (u, *self.graph[u]) if v in self.adverts} for u in self.adverts}

    # ---- stage 2 -> 3 ---------------------------------------------------------------------------
    def take_shares(self, replies: Mapping[int, tuple[bytes, Mapping[int, bytes]]]) -> dict[int, dict[int, bytes]]:
        """Each remaining node's ciphertexts for stage 3 (dealer -> ciphertext)."""
        for node, (commitment, ciphertexts) in replies.items():
            if node not in self.adverts:
                self._exclude(node, "it dealt shares without having advertised keys")
                continue
            holders = {v for v in self.graph[node] if v in self.adverts}  # U1 stays as stage 2 saw it
            why = ""
            if not (isinstance(commitment, bytes) and len(commitment) == 32):
                why = "its seed commitment is not 32 bytes"
            elif set(ciphertexts) != holders:
                why = f"it dealt shares to {sorted(ciphertexts)}, not to its neighbours with keys {sorted(holders)}"
            elif any(not isinstance(c, bytes) or len(c) > MAX_CIPHERTEXT_BYTES for c in ciphertexts.values()):
                why = f"a ciphertext is not bytes or longer than {MAX_CIPHERTEXT_BYTES} bytes"
            if why:
                self._exclude(node, why)
                continue
            self.commitments[node] = commitment
            self.dealt[node] = dict(ciphertexts)
        self._prune(self.dealt, "dealt shares")
        return {v: {u: self.dealt[u][v] for u in self.graph[v] if u in self.dealt} for v in self.dealt}

    # ---- stage 3 -> 4 ---------------------------------------------------------------------------
    def take_masked(
        self, replies: Mapping[int, np.ndarray], complaints: Mapping[int, list[int]] | None = None
    ) -> dict[int, tuple[list[int], list[int]]]:
        """Each surviving node's unmasking request: (survivors, dropped) among its neighbours.
        ``complaints``: holder -> the dealers whose shares it could not decrypt (``NodeRound.complaints``),
        named if their secrets then cannot be rebuilt."""
        for holder, dealers in (complaints or {}).items():
            for dealer in dealers:
                self.complaints.setdefault(dealer, []).append(holder)
        for node, vector in replies.items():
            v = np.asarray(vector)
            if node not in self.dealt:
                self._exclude(node, "it sent a masked vector without having dealt shares")
            elif v.dtype != np.uint64 or v.shape != (self.size,):
                self._exclude(node, f"its masked vector is {v.dtype} {v.shape}, not uint64 ({self.size},)")
            elif v.size and int(v.max()) >= modulus(self.bits):
                self._exclude(node, f"its masked vector holds values past the modulus 2^{self.bits}")
            else:
                self.masked[node] = v
        requests = {}
        for u in self.masked:
            alive = sorted([u, *(v for v in self.graph[u] if v in self.masked)])
            if len(alive) < self.threshold:
                raise SecAggError(
                    f"round {self.server_round}: node {u} has {len(alive)} survivors among its neighbours and "
                    f"itself, fewer than the threshold {self.threshold}: its mask cannot be removed"
                )
            gone = sorted(v for v in self.graph[u] if v in self.dealt and v not in self.masked)
            requests[u] = (alive, gone)
        if len(self.masked) < self.threshold:
            raise SecAggError(
                f"round {self.server_round}: {len(self.masked)} masked vectors came back, fewer than the "
                f"threshold {self.threshold}"
            )
        return requests

    # ---- stage 4: the sum -------------------------------------------------------------------------
    def unmask(self, replies: Mapping[int, tuple[Mapping[int, bytes], Mapping[int, bytes]]]) -> np.ndarray:
        """The sum of the surviving nodes' vectors modulo 2^bits (uint64), from the shares they
        returned (holder -> (seed shares, key shares), each dealer -> share)."""
        seeds: dict[int, dict[int, bytes]] = {}
        keys: dict[int, dict[int, bytes]] = {}
        for holder, (seed_shares, key_shares) in replies.items():
            if holder not in self.masked:
                continue  # it dropped before sending its vector: its word is not needed
            self.revealers.append(holder)
            for dealer, share in seed_shares.items():
                seeds.setdefault(dealer, {})[holder] = share
            for dealer, share in key_shares.items():
                keys.setdefault(dealer, {})[holder] = share
        total = np.zeros(self.size, dtype=np.uint64)
        for u, vector in self.masked.items():
            seed = self._recover(u, seeds.get(u, {}), SEED)
            total = reduce(total + vector - expand(seed, self.size, self.bits), self.bits)
        for v in self.dealt:
            if v in self.masked:
                continue
            mask_key = key_from_scalar(self._recover(v, keys.get(v, {}), MASK_KEY))
            for u in self.graph[v]:
                if u in self.masked:  # u added sign(u, v) * PRG(s_uv): take it out
                    m = expand(pair_seed(mask_key, self.adverts[u][1]), self.size, self.bits)
                    total = total - m if pair_sign(u, v) > 0 else total + m
            total = reduce(total, self.bits)
        return total

    def report(self) -> dict:
        """What results.json records of the round's protocol."""
        return {
            "threshold": self.threshold,
            "bits": self.bits,
            "neighbours": max((len(p) for p in self.graph.values()), default=0),
            "asked": len(self.graph),
            "advertised": len(self.adverts),
            "dealt": len(self.dealt),
            "masked": len(self.masked),
            "revealed": len(self.revealers),
            "excluded": {str(k): v for k, v in sorted(self.excluded.items())},
            "forged_shares": {str(k): v for k, v in sorted(self.forged.items())},
            "undecryptable_shares": {str(k): sorted(v) for k, v in sorted(self.complaints.items())},
        }

    # ---- helpers ----------------------------------------------------------------------------------
    def _exclude(self, node: int, why: str) -> None:
        """Record why ``node`` leaves the round (the caller leaves it out of its stage)."""
        self.excluded.setdefault(node, why)

    def _prune(self, members: dict, what: str) -> None:
        """Leave out, until none is left, the members with fewer than threshold - 1 neighbours
        among the members: their secrets could not be rebuilt if they dropped out."""
        while True:
            short = [u for u in members if sum(v in members for v in self.graph[u]) < self.threshold - 1]
            if not short:
                return
            for u in short:
                self._exclude(u, f"fewer than threshold - 1 = {self.threshold - 1} of its neighbours {what}")
                del members[u]

    def _fits(self, owner: int, what: str, secret: bytes) -> bool:
        """Whether ``secret`` is what ``owner`` published of its ``what``: the seed's commitment, or
        the mask key's public key."""
        if what == SEED:
            return seed_commitment(secret) == self.commitments[owner]
        return _public(secret) == self.adverts[owner][1]

    def _subsets(self, holders: list[int]):
        """Threshold-many holders to rebuild a secret from: the first ones, then leaving out one
        holder at a time, then two: one or two forgers among many holders are found in as many
        tries as there are holders (or pairs), not among all the combinations."""
        seen = set()
        for left_out in itertools.chain([()], itertools.combinations(holders, 1), itertools.combinations(holders, 2)):
            rest = [h for h in holders if h not in left_out]
            subset = tuple(rest[: self.threshold])
            if len(subset) == self.threshold and subset not in seen:
                seen.add(subset)
                yield subset

    def _recover(self, owner: int, shares: dict[int, bytes], what: str) -> bytes:
        """``owner``'s secret ``what`` from the ``shares`` returned (holder -> share), checked
        against what it published. Threshold-many shares rebuild it (the first such set that
        fits; each try costs a Lagrange interpolation in GF(2^128)); once one set failed, the
        holders whose shares do not fit the secret a later set rebuilt are recorded as forgers.
        A forged share outside the first set is never used, so it is left out unnamed."""
        if len(shares) < self.threshold:
            blamed = self.complaints.get(owner)
            raise SecAggError(
                f"round {self.server_round}: {len(shares)} shares of node {owner}'s {what} came back, fewer than "
                f"the threshold {self.threshold}"
                + (f"; nodes {sorted(blamed)} could not decrypt the shares it dealt them" if blamed else "")
            )
        holders = sorted(shares)
        tried = itertools.islice(self._subsets(holders), SUBSETS_TRIED)
        for attempt, subset in enumerate(tried):
            secret = _combine([shares[h] for h in subset])
            if secret is not None and self._fits(owner, what, secret):
                for h in sorted(set(holders) - set(subset)) if attempt else ():
                    if _combine([shares[x] for x in (*subset[: self.threshold - 1], h)]) != secret:
                        self.forged[h] = f"its share of node {owner}'s {what} does not fit the others"
                return secret
        blamed = self.complaints.get(owner)
        why = (
            f"nodes {sorted(blamed)} could not decrypt the shares it dealt them"
            if blamed
            else f"shares were forged (holders {holders})"
        )
        raise SecAggError(
            f"round {self.server_round}: node {owner}'s {what} cannot be rebuilt from the {len(shares)} shares "
            f"returned to match what it published: {why}; the round is discarded"
        )


def _advert_problem(advert: object) -> str:
    if not (isinstance(advert, (tuple, list)) and len(advert) == 2):
        return "it did not advertise two public keys"
    for key in advert:
        if not isinstance(key, bytes) or len(key) > MAX_KEY_BYTES:
            return f"an advertised key is not bytes of at most {MAX_KEY_BYTES}"
        try:
            public = bytes_to_public_key(key)
        except (ValueError, TypeError):
            return "an advertised key is not a PEM public key"
        if not isinstance(public, ec.EllipticCurvePublicKey) or not isinstance(public.curve, ec.SECP384R1):
            return "an advertised key is not a P-384 elliptic-curve key"
    return ""


def _combine(shares: list[bytes]) -> bytes | None:
    try:
        return combine_shares(shares)
    except (ValueError, IndexError, TypeError):
        return None


def _public(scalar: bytes) -> bytes | None:
    """The public key of the private key ``scalar`` stands for (None: it stands for none)."""
    try:
        return public_key_to_bytes(bytes_to_private_key(key_from_scalar(scalar)).public_key())
    except (ValueError, TypeError):
        return None
