"""The server's side of a round of secure aggregation: relay the nodes' signed keys and encrypted
shares, collect the masked vectors and the nodes' signatures on who survived, and remove the
masks from their sum with the shares the survivors return. The server never holds what would
unmask one node: a survivor's pairwise masks stay (only their sum cancels), a dropped node's self
mask stays (its vector is not in the sum).

Who takes part shrinks stage by stage (SecAgg+'s U1 ... U5): the nodes whose adverts are well
formed and signed (by a member of the roster, where the server holds one); those that dealt a
share to every neighbour; those whose masked vector, sent with their shares, is well formed and
stays one connected piece of the graph with t - 1 neighbours each; those whose signature on that
story verifies; those that returned shares. A survivor masked with every neighbour of the graph:
the mask with a neighbour that never dealt comes out with the survivor's own seed for it, which it
returns once the story is signed; with one that dealt and dropped, with that node's rebuilt mask
key. A node that sends something malformed (a key that is not a public
key, a key or member another node uses, a share list that skips a neighbour, a vector of the
wrong size or past the modulus, a signature that does not verify) is excluded with the reason, as
a dropout is, and the round goes on while it can. A secret that cannot be rebuilt to match what
its owner published (the seed's commitment, the mask key's public key) from the shares returned,
even leaving forged shares out, fails the round (``SecAggError``): no sum, rather than a wrong one.

The server runs the same derivations as the nodes (``secagg.node``: the session, the graph, the
story), so that an honest server's messages pass every node's checks; nothing here is trusted by
a node.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedvlm.secagg import shamir
from fedvlm.secagg.graph import neighbours, reach
from fedvlm.secagg.masks import SEED_BYTES, expand, modulus, reduce
from fedvlm.secagg.node import (
    DH_BYTES,
    advert_message,
    key_from_scalar,
    pair_seed,
    pair_sign,
    public_of,
    quorum,
    seed_commitment,
    session,
    story_message,
    usable_key,
)
from fedvlm.secagg.roster import KEY_BYTES, SIGNATURE_BYTES, Roster, verify
from fedvlm.secagg.stages import Advert, SumPlan

MAX_CIPHERTEXT_BYTES = 8192  # two shares of 68 bytes and their framing, encrypted (about 300 bytes)
SEED, MASK_KEY = "seed", "mask key"  # the two secrets a node deals shares of
SUBSETS_TRIED = 64  # t-subsets of a secret's shares tried when the full set was forged


class SecAggError(RuntimeError):
    """The round's sum cannot be recovered; nothing of it is released."""


@dataclass
class ServerRound:
    """The server's view of one round (node ids are Flower's)."""

    plan: SumPlan
    size: int  # the length of every node's vector
    roster: Roster | None = None  # the federation's, where the server holds it (else adverts are checked alone)
    adverts: dict[int, Advert] = field(default_factory=dict)  # U1
    session: bytes = b""
    graph: dict[int, tuple[int, ...]] = field(default_factory=dict)
    commitments: dict[int, bytes] = field(default_factory=dict)
    dealt: dict[int, dict[int, bytes]] = field(default_factory=dict)  # U2: dealer -> holder -> ciphertext
    masked: dict[int, np.ndarray] = field(default_factory=dict)  # U3
    signatures: dict[int, bytes] = field(default_factory=dict)  # U4: signer -> its signature on the story
    revealers: list[int] = field(default_factory=list)  # U5
    excluded: dict[int, str] = field(default_factory=dict)  # node -> why it was left out
    forged: dict[int, str] = field(default_factory=dict)  # holder -> which of its returned shares did not fit
    complaints: dict[int, list[int]] = field(default_factory=dict)  # dealer -> holders that could not decrypt its share

    def __post_init__(self) -> None:
        modulus(self.plan.bits)

    # ---- stage 1 -> 2 ---------------------------------------------------------------------------
    def take_adverts(self, replies: Mapping[int, Advert], signed_over: bytes = b"") -> dict[int, Advert]:
        """U1: the well-formed, signed adverts (every node of U1 is shown all of them); the graph
        and the session follow from them. ``signed_over``: ``PREKEYED`` for the nodes' prekeys
        (``secagg.node.Prekey``), else the adverts are signed over the plan's digest."""
        digest = self.plan.digest
        for node, advert in replies.items():
            why = _advert_problem(node, advert, self.plan, signed_over or digest, self.roster)
            if why:
                self._exclude(node, why)
            else:
                self.adverts[node] = advert
        owners: dict[bytes, set[int]] = {}
        for node, advert in self.adverts.items():
            for key in (advert.identity, advert.encryption, advert.mask):
                owners.setdefault(key, set()).add(node)
        repeated = {n for nodes in owners.values() if len(nodes) > 1 for n in nodes}
        repeated |= {node for node, a in self.adverts.items() if a.encryption == a.mask}
        for node in sorted(repeated):
            self._exclude(node, "it advertised a key or a member that another advert of the round repeats")
            del self.adverts[node]
        if len(self.adverts) < self.plan.threshold:
            raise SecAggError(
                f"round {self.plan.server_round}: {len(self.adverts)} nodes advertised keys, fewer than the threshold "
                f"{self.plan.threshold}"
            )
        self.session = session(digest, self.adverts)
        self.graph = neighbours(sorted(self.adverts), self.plan.degree, self.session)
        return dict(self.adverts)

    # ---- stage 2 -> 3 ---------------------------------------------------------------------------
    def take_shares(
        self, replies: Mapping[int, tuple[bytes, Mapping[int, bytes], np.ndarray]]
    ) -> dict[int, dict[int, bytes]]:
        """U2 (the nodes that dealt a share to every neighbour) and U3 (those of them whose
        well-formed masked vectors go into the sum, kept to one connected piece of the graph with
        t - 1 neighbours each: what every node checks before it signs), from each node's
        commitment, ciphertexts and masked vector; each survivor's ciphertexts for stage 3
        (dealer -> ciphertext)."""
        for node, (commitment, ciphertexts, _) in replies.items():
            why = self._dealing_problem(node, commitment, ciphertexts)
            if why:
                self._exclude(node, why)
                continue
            self.commitments[node] = commitment
            self.dealt[node] = dict(ciphertexts)
        self._prune(self.dealt, "dealt shares")
        self._take_vectors({u: vector for u, (_, _, vector) in replies.items() if u in self.dealt})
        return {v: {u: self.dealt[u][v] for u in self.graph[v] if u in self.dealt} for v in self.masked}

    def _dealing_problem(self, node: int, commitment: object, ciphertexts: Mapping[int, bytes]) -> str:
        """Why ``node``'s shares cannot be routed ("" if they can)."""
        if node not in self.adverts:
            return "it dealt shares without having advertised keys"
        if not (isinstance(commitment, bytes) and len(commitment) == 32):
            return "its seed commitment is not 32 bytes"
        if set(ciphertexts) != set(self.graph[node]):
            return f"it dealt shares to {sorted(ciphertexts)}, not to its neighbours {sorted(self.graph[node])}"
        if any(not isinstance(c, bytes) or len(c) > MAX_CIPHERTEXT_BYTES for c in ciphertexts.values()):
            return f"a ciphertext is not bytes or longer than {MAX_CIPHERTEXT_BYTES} bytes"
        return ""

    def _take_vectors(self, replies: Mapping[int, np.ndarray]) -> None:
        for node, vector in replies.items():
            v = np.asarray(vector)
            if v.dtype != np.uint64 or v.shape != (self.size,):
                self._exclude(node, f"its masked vector is {v.dtype} {v.shape}, not uint64 ({self.size},)")
            elif v.size and int(v.max()) >= modulus(self.plan.bits):
                self._exclude(node, f"its masked vector holds values past the modulus 2^{self.plan.bits}")
            else:
                self.masked[node] = v
        self._prune(self.masked, "in the sum")
        pieces = _pieces(self.graph, self.masked)
        for piece in pieces[1:]:
            for node in piece:
                self._exclude(node, "its masked vector is not connected to the largest piece of the survivors")
                del self.masked[node]
        least = max(self.plan.threshold, quorum(len(self.plan.participants)))
        if len(self.masked) < least:
            raise SecAggError(
                f"round {self.plan.server_round}: {len(self.masked)} masked vectors can go into the sum, fewer than "
                f"{least} (the threshold, and a strict majority of the round's {len(self.plan.participants)} "
                "participants, who must sign it)"
            )

    # ---- stage 3 -> 4 ---------------------------------------------------------------------------
    def take_signatures(self, replies: Mapping[int, tuple[bytes, list[int]]]) -> dict[int, bytes]:
        """U4: the survivors whose signature on the story verifies; what each of them is shown.
        A node reveals only with a strict majority of the participants and t of its own
        neighbourhood among the signers: the server checks both as the node will. Each reply also
        names the dealers whose shares its node could not decrypt (``NodeRound.complaints``),
        named if their secrets then cannot be rebuilt."""
        story = story_message(self.session, self.dealt, self.masked)
        for node, (_, dealers) in replies.items():
            for dealer in dealers if node in self.masked else ():
                self.complaints.setdefault(dealer, []).append(node)
        for node, (signature, _) in replies.items():
            if node not in self.masked:
                self._exclude(node, "it signed a story without being among the survivors")
            elif not verify(self.adverts[node].identity, story, signature):
                self._exclude(node, "its signature on the survivors does not verify")
            else:
                self.signatures[node] = signature
        need = quorum(len(self.plan.participants))
        if len(self.signatures) < need:
            raise SecAggError(
                f"round {self.plan.server_round}: {len(self.signatures)} survivors signed the story, fewer than the "
                f"{need} (a strict majority of the participants) a node waits for before it reveals"
            )
        return dict(self.signatures)

    # ---- stage 4: the sum -------------------------------------------------------------------------
    def unmask(self, replies: Mapping[int, tuple[Mapping[int, bytes], ...]]) -> np.ndarray:
        """The sum of the surviving nodes' vectors modulo 2^bits (uint64), from what they returned
        (holder -> (seed shares, key shares, its pairwise seeds with neighbours that never dealt))."""
        seeds, keys, pairs = self._returned(replies)
        total = np.zeros(self.size, dtype=np.uint64)
        for u, vector in self.masked.items():
            seed = self._recover(u, seeds.get(u, {}), SEED)
            total = reduce(total + vector - expand(seed, self.size, self.plan.bits), self.plan.bits)
        for v in set(self.adverts) - set(self.masked):
            mask_key = key_from_scalar(self._recover(v, keys.get(v, {}), MASK_KEY)) if v in self.dealt else None
            for u in self.graph[v]:
                if u not in self.masked:
                    continue
                if mask_key is not None:
                    seed = pair_seed(mask_key, self.adverts[u].mask, self.session)
                elif v in pairs.get(u, {}):
                    seed = pairs[u][v]
                else:
                    raise SecAggError(
                        f"round {self.plan.server_round}: node {u} did not return its pairwise seed with node {v}, "
                        "which never dealt its shares: the mask between them cannot be removed; the round is discarded"
                    )
                m = expand(seed, self.size, self.plan.bits)  # u added sign(u, v) * PRG(s_uv): take it out
                total = total - m if pair_sign(u, v) > 0 else total + m
            total = reduce(total, self.plan.bits)
        return total

    def _returned(self, replies: Mapping[int, tuple[Mapping[int, bytes], ...]]) -> tuple[dict, dict, dict]:
        """The signers' returns, by owner (seed and key shares: owner -> holder -> share) and by
        holder (pairwise seeds: holder -> neighbour -> seed); a holder that returns what it cannot
        hold is left out."""
        seeds: dict[int, dict[int, bytes]] = {}
        keys: dict[int, dict[int, bytes]] = {}
        pairs: dict[int, dict[int, bytes]] = {}
        gone, never = set(self.dealt) - set(self.masked), set(self.adverts) - set(self.dealt)
        for holder, (seed_shares, key_shares, pair_seeds) in replies.items():
            if holder not in self.signatures:
                continue  # it did not sign the story: its word is not needed
            holds = {holder, *self.graph[holder]}
            if (
                not set(seed_shares) <= holds & set(self.masked)
                or not set(key_shares) <= holds & gone
                or not set(pair_seeds) <= set(self.graph[holder]) & never
                or any(not isinstance(x, bytes) or len(x) != SEED_BYTES for x in pair_seeds.values())
            ):
                self._exclude(holder, "it returned shares of nodes it holds none of, or of the wrong secret")
                continue
            self.revealers.append(holder)
            for dealer, share in seed_shares.items():
                seeds.setdefault(dealer, {})[holder] = share
            for dealer, share in key_shares.items():
                keys.setdefault(dealer, {})[holder] = share
            pairs[holder] = dict(pair_seeds)
        return seeds, keys, pairs

    def report(self) -> dict:
        """What results.json records of the round's protocol."""
        return {
            "threshold": self.plan.threshold,
            "bits": self.plan.bits,
            "neighbours": max((len(p) for p in self.graph.values()), default=0),
            "asked": len(self.plan.participants),
            "advertised": len(self.adverts),
            "dealt": len(self.dealt),
            "masked": len(self.masked),
            "signed": len(self.signatures),
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
        among the members: their secrets could not be rebuilt if they dropped out, and every node
        refuses to sign a story with fewer than t of its neighbourhood in the sum."""
        while True:
            short = [u for u in members if sum(v in members for v in self.graph[u]) < self.plan.threshold - 1]
            if not short:
                return
            for u in short:
                self._exclude(u, f"fewer than threshold - 1 = {self.plan.threshold - 1} of its neighbours {what}")
                del members[u]

    def _fits(self, owner: int, what: str, secret: bytes) -> bool:
        """Whether ``secret`` is what ``owner`` published of its ``what``: the seed's commitment, or
        the mask key's public key."""
        if what == SEED:
            return seed_commitment(secret) == self.commitments[owner]
        return _public(secret) == self.adverts[owner].mask

    def _subsets(self, holders: list[int]):
        """Threshold-many holders to rebuild a secret from: the first ones, then leaving out one
        holder at a time, then two: one or two forgers among many holders are found in as many
        tries as there are holders (or pairs), not among all the combinations."""
        seen = set()
        for left_out in itertools.chain([()], itertools.combinations(holders, 1), itertools.combinations(holders, 2)):
            rest = [h for h in holders if h not in left_out]
            subset = tuple(rest[: self.plan.threshold])
            if len(subset) == self.plan.threshold and subset not in seen:
                seen.add(subset)
                yield subset

    def _recover(self, owner: int, shares: dict[int, bytes], what: str) -> bytes:
        """``owner``'s secret ``what`` from the ``shares`` returned (holder -> share), checked
        against what it published. Threshold-many shares rebuild it (the first such set that
        fits; each try costs a Lagrange interpolation, ``secagg.shamir``); once one set failed, the
        holders whose shares do not fit the secret a later set rebuilt are recorded as forgers.
        A forged share outside the first set is never used, so it is left out unnamed."""
        if len(shares) < self.plan.threshold:
            blamed = self.complaints.get(owner)
            raise SecAggError(
                f"round {self.plan.server_round}: {len(shares)} shares of node {owner}'s {what} came back, fewer than "
                f"the threshold {self.plan.threshold}"
                + (f"; nodes {sorted(blamed)} could not decrypt the shares it dealt them" if blamed else "")
            )
        holders = sorted(shares)
        tried = itertools.islice(self._subsets(holders), SUBSETS_TRIED)
        for attempt, subset in enumerate(tried):
            secret = _combine([shares[h] for h in subset])
            if secret is not None and self._fits(owner, what, secret):
                for h in sorted(set(holders) - set(subset)) if attempt else ():
                    if _combine([shares[x] for x in (*subset[: self.plan.threshold - 1], h)]) != secret:
                        self.forged[h] = f"its share of node {owner}'s {what} does not fit the others"
                return secret
        blamed = self.complaints.get(owner)
        why = (
            f"nodes {sorted(blamed)} could not decrypt the shares it dealt them"
            if blamed
            else f"shares were forged (holders {holders})"
        )
        raise SecAggError(
            f"round {self.plan.server_round}: node {owner}'s {what} cannot be rebuilt from the {len(shares)} shares "
            f"returned to match what it published: {why}; the round is discarded"
        )


def _pieces(graph: Mapping[int, tuple[int, ...]], members: Mapping[int, object]) -> list[list[int]]:
    """The connected pieces of ``graph`` among ``members``, the largest first (ties: smallest id)."""
    left, pieces = set(members), []
    while left:
        piece = reach(graph, min(left), left)
        pieces.append(sorted(piece))
        left -= piece
    return sorted(pieces, key=lambda p: (-len(p), p[0]))


def _advert_problem(node: int, advert: object, plan: SumPlan, signed_over: bytes, roster: Roster | None) -> str:
    """Why ``advert`` cannot be relayed ("" if it can): what every node would refuse of it."""
    if node not in plan.participants:
        return "it was not asked to take part"
    if not isinstance(advert, Advert):
        return "it did not advertise two public keys, an identity key and a signature"
    if not (isinstance(advert.identity, bytes) and len(advert.identity) == KEY_BYTES):
        return f"its identity key is not {KEY_BYTES} bytes"
    if not (isinstance(advert.signature, bytes) and len(advert.signature) == SIGNATURE_BYTES):
        return f"its signature is not {SIGNATURE_BYTES} bytes"
    if roster is not None and roster.member(advert.identity) is None:
        return "its identity key is not on the roster"
    if not (usable_key(advert.encryption) and usable_key(advert.mask)):
        return f"an advertised key is not an X25519 public key ({DH_BYTES} bytes) of full order"
    if not verify(advert.identity, advert_message(signed_over, node, advert.encryption, advert.mask), advert.signature):
        return "its keys do not carry its identity key's signature over the round's plan (or its prekey)"
    return ""


def _combine(shares: list[bytes]) -> bytes | None:
    try:
        return shamir.combine(shares)
    except ValueError:
        return None


def _public(scalar: bytes) -> bytes | None:
    """The public key of the private key ``scalar`` stands for (None: it stands for none)."""
    try:
        return public_of(key_from_scalar(scalar))
    except (ValueError, TypeError):
        return None
