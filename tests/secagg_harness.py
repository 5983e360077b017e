"""Secure aggregation's protocol driven in one process: honest nodes (real ``secagg.node.NodeRound``
objects, each with its own identity key on one roster), an honest server (``ServerRound``), or a
server that deviates, and an oracle of what a server can unmask from what the nodes gave it.

The oracle (``unmaskable``) works from the nodes' true state, not from the server's claims: a sum
over a set S of the nodes that sent masked vectors is in the server's reach when it can rebuild the
self-mask seed of every node of S from the shares nodes revealed, and every pairwise mask term a
node of S added either cancels inside S (both ends added it, in one session, with the keys each
really holds) or is removable with a mask key the server rebuilt. A protocol that holds leaves
only sums of at least t nodes in reach, whatever the server told each node.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field

import numpy as np

from fedvlm.secagg import shamir
from fedvlm.secagg.graph import degree
from fedvlm.secagg.masks import decode, encode, expand, reduce
from fedvlm.secagg.node import (
    PREKEYED,
    NodeRound,
    Prekey,
    SecAggRefused,
    key_from_scalar,
    majority_threshold,
    pair_seed,
    pair_sign,
    seed_commitment,
)
from fedvlm.secagg.roster import Identity, Roster
from fedvlm.secagg.server import ServerRound
from fedvlm.secagg.stages import Advert, SumPlan

BITS, SIZE = 32, 257


@dataclass
class Round:
    """One round's honest nodes, before the server speaks."""

    ids: list[int]
    plan: SumPlan
    roster: Roster
    identities: dict[int, Identity]
    values: dict[int, np.ndarray]
    nodes: dict[int, NodeRound] = field(default_factory=dict)
    adverts: dict[int, Advert] = field(default_factory=dict)

    @property
    def t(self) -> int:
        return self.plan.threshold

    def start(self, ids=None, floor: int = 0, prekeyed: bool = False) -> None:
        """Each node keys the round: with a fresh advert signed over the plan, or with its prekey."""
        for u in self.ids if ids is None else ids:
            if prekeyed:
                key = Prekey.new(u, self.identities[u])
                self.nodes[u] = NodeRound.from_prekey(u, self.plan, self.roster, self.identities[u], key, floor)
                self.adverts[u] = key.advert
            else:
                self.nodes[u], self.adverts[u] = NodeRound.start(u, self.plan, self.roster, self.identities[u], floor)

    def vector(self, u: int) -> np.ndarray:
        return encode(self.values[u], self.plan.bits)


def make_round(n: int, k: int = 0, seed: int = 0, threshold: int | None = None, **plan) -> Round:
    ids = [101 + 7 * i for i in range(n)]
    roster = Roster.simulated(seed, n)
    identities = {u: Identity.simulated(seed, i) for i, u in enumerate(ids)}
    t = threshold if threshold is not None else max(2, majority_threshold(degree(k, n) + 1))
    fields = dict(
        server_round=1,
        participants=tuple(ids),
        degree=k,
        threshold=t,
        bits=BITS,
        names=("x",),
        sizes=(SIZE - 1,),
        weighted=False,
        gamma=1.0,
        norm_bound=1.0,
        client_sigma=0.0,
        n_min=0,
        roster=roster.digest,
    )
    fields.update(plan)
    rng = np.random.default_rng(seed + 1)
    values = {u: rng.integers(-1000, 1000, SIZE) for u in ids}
    return Round(ids, SumPlan(**fields), roster, identities, values)


def run_honest(n, k=0, drop=None, tamper=None, seed=0, prekeyed=False):
    """The whole protocol with an honest server; ``drop``: stage -> nodes that stop answering
    before it; ``tamper``: (stage, node id, reply) -> a changed reply (the shares stage's reply is
    (commitment, ciphertexts, masked vector), the consistency stage's (signature, complaints));
    ``prekeyed``: the nodes key the round with their prekeys (``secagg.node.Prekey``), which the
    server relays."""
    drop, tamper = drop or {}, tamper or (lambda stage, u, r: r)
    r = make_round(n, k, seed)
    r.start([u for u in r.ids if u not in drop.get("keys", ())], prekeyed=prekeyed)
    server = ServerRound(r.plan, SIZE, r.roster)
    signed_over = PREKEYED if prekeyed else b""
    adverts = server.take_adverts({u: tamper("keys", u, a) for u, a in r.adverts.items()}, signed_over)
    dealt = {}
    for u in adverts:
        if u not in drop.get("shares", ()):
            commitment, ciphertexts = r.nodes[u].share(adverts, r.roster)
            dealt[u] = tamper("shares", u, (commitment, ciphertexts, r.nodes[u].mask(r.vector(u))))
    routed = server.take_shares(dealt)
    signed = {}
    for u, ciphertexts in routed.items():
        if u in drop.get("consistency", ()):
            continue
        r.nodes[u].receive(server.dealt, ciphertexts)
        signature = r.nodes[u].sign_story(sorted(server.masked), r.identities[u])
        signed[u] = tamper("consistency", u, (signature, sorted(r.nodes[u].complaints)))
    signatures = server.take_signatures(signed)
    revealed = {
        u: tamper("unmask", u, r.nodes[u].reveal(signatures)) for u in signatures if u not in drop.get("unmask", ())
    }
    total = server.unmask(revealed)
    expected = sum((r.values[u] for u in server.masked), np.zeros(SIZE, dtype=np.int64))
    return decode(total, BITS), expected, server, r


# ---- what a server can unmask ------------------------------------------------------------------
def rebuilt(r: Round, revealed: dict[int, tuple[dict[int, bytes], ...]]) -> tuple[set[int], set[int], set]:
    """The nodes whose self-mask seed, and whose mask key, the server can rebuild from every
    share any node revealed (holder -> (seed shares, key shares, pairwise seeds), shares by
    owner), and the (holder, neighbour) pairs whose pairwise seed the holder revealed."""
    seeds: dict[int, list[bytes]] = {}
    keys: dict[int, list[bytes]] = {}
    pairs = set()
    for holder, (seed_shares, key_shares, pair_seeds) in revealed.items():
        for owner, share in seed_shares.items():
            seeds.setdefault(owner, []).append(share)
        for owner, share in key_shares.items():
            keys.setdefault(owner, []).append(share)
        pairs |= {(holder, j) for j, seed in pair_seeds.items() if seed == r.nodes[holder]._pair_seed(j)}
    got_seeds = {
        u
        for u, s in seeds.items()
        if _opens(s, r.t, lambda x, u=u: seed_commitment(x) == seed_commitment(r.nodes[u].seed))
    }
    got_keys = {u for u, s in keys.items() if _opens(s, r.t, lambda x, u=u: x == r.nodes[u].mask_key)}
    return got_seeds, got_keys, pairs


def _opens(shares: list[bytes], t: int, fits) -> bool:
    unique = list(dict.fromkeys(shares))
    if len(unique) < t:
        return False
    for subset in itertools.islice(itertools.combinations(unique, t), 50):
        try:
            if fits(shamir.combine(list(subset))):
                return True
        except ValueError:
            continue
    return False


def _same_pair(r: Round, u: int, j: int) -> bool:
    """Whether u and j agree on their pairwise seed: one session, each holding the other's real key."""
    a, b = r.nodes[u], r.nodes.get(j)
    return b is not None and a.session == b.session and a.adverts[j] == b.adverts[j] and b.adverts[u] == a.adverts[u]


def _cancels(r: Round, u: int, j: int, members: set[int]) -> bool:
    return j in members and u in r.nodes[j].peers and _same_pair(r, u, j)


def _removable(r: Round, u: int, j: int, keys: set[int], pairs: set) -> bool:
    """Whether the server can compute u's pairwise mask term with j: from u's mask key or its
    revealed seed with j, or from the key j really holds (or j's revealed seed with u) when both
    agree on the pair."""
    if u in keys or (u, j) in pairs:
        return True
    b = r.nodes.get(j)
    if j in keys and b is not None and r.nodes[u].adverts[j].mask == b.adverts[j].mask:
        return True
    return (j, u) in pairs and _same_pair(r, u, j)


def unmaskable(r: Round, sent: set[int], revealed) -> list[frozenset[int]]:
    """Every set of the nodes that sent masked vectors (``sent``) whose sum the server can unmask."""
    seeds, keys, pairs = rebuilt(r, revealed)
    out = []
    for size in range(1, len(sent) + 1):
        for members in itertools.combinations(sorted(sent & seeds), size):
            s = set(members)
            if all(_cancels(r, u, j, s) or _removable(r, u, j, keys, pairs) for u in s for j in r.nodes[u].peers):
                out.append(frozenset(s))
    return out


def unmask_numerically(r: Round, members: frozenset[int], masked: dict[int, np.ndarray], revealed) -> np.ndarray:
    """The sum over ``members`` as a server computes it from what it was given (to check the oracle)."""
    seeds, keys, pairs = rebuilt(r, revealed)
    assert members <= seeds
    total = np.zeros(SIZE, dtype=np.uint64)
    for u in members:
        node = r.nodes[u]
        total = reduce(total + masked[u] - expand(node.seed, SIZE, BITS), BITS)
        for j in node.peers:
            if _cancels(r, u, j, set(members)):
                continue
            if u in keys or (u, j) in pairs:
                seed = pair_seed(node.mask_key, node.adverts[j].mask, node.session)
            elif (j, u) in pairs:
                seed = r.nodes[j]._pair_seed(u)
            else:
                seed = pair_seed(key_from_scalar(r.nodes[j].mask_key), node.adverts[u].mask, node.session)
            m = expand(seed, SIZE, BITS)
            total = reduce(total - m if pair_sign(u, j) > 0 else total + m, BITS)
    return decode(total, BITS)


def attempt(call):
    """What the node's ``call`` returns, or None where the node refuses."""
    try:
        return call()
    except SecAggRefused:
        return None


def sign_and_reveal(r: Round, masked, story_of) -> dict:
    """Every node that sent a masked vector is told a story (``story_of``: node -> (dealers, the
    ciphertexts routed to it, survivors)), takes its shares and signs it where it goes along, and
    every signer is shown every signature: what each one then revealed."""
    signatures = {}
    for u in masked:
        dealers, ciphertexts, survivors = story_of(u)

        def sign(u=u, dealers=dealers, ciphertexts=ciphertexts, survivors=survivors):
            r.nodes[u].receive(dealers, ciphertexts)
            return r.nodes[u].sign_story(survivors, r.identities[u])

        signature = attempt(sign)
        if signature is not None:
            signatures[u] = signature
    revealed = {}
    for u in signatures:
        shares = attempt(lambda u=u: r.nodes[u].reveal(signatures))
        if shares is not None:
            revealed[u] = shares
    return revealed


def refuses(call) -> str:
    """The node's refusal text, or '' where it went along."""
    try:
        call()
    except SecAggRefused as why:
        return str(why)
    return ""


# ---- servers that deviate -----------------------------------------------------------------------
def group_attack(n: int, k: int, rng: np.random.Generator):
    """One round against a server that splits the nodes into groups and tells each group its own
    story (the adverts it shows, who dealt, who survived), drops dealers and survivors at random,
    fakes the ciphertexts it cannot deliver, and shows every node every signature it collected.
    Returns the round, the nodes that sent masked vectors, those vectors, and what was revealed."""
    r = make_round(n, k, seed=int(rng.integers(1 << 30)))
    r.start()
    groups = dict(zip(r.ids, rng.integers(0, int(rng.integers(1, 4)), n).tolist(), strict=True))
    stories = {}
    for g in set(groups.values()):
        members = {u for u in r.ids if groups[u] == g}
        shown = members | {u for u in r.ids if rng.random() < 0.7}
        dealers = members | {u for u in shown if rng.random() < 0.8}
        stories[g] = (sorted(shown), sorted(dealers), rng.random(n))
    shared, masked = _deal(r, lambda u: {v: r.adverts[v] for v in stories[groups[u]][0]})

    def story(u):
        shown, dealers, draws = stories[groups[u]]
        dealers = [v for v in dealers if v in shown]
        survivors = [v for i, v in enumerate(r.ids) if v == u or (v in masked and draws[i] < 0.8)]
        return dealers, _routed(r, u, shared, dealers), survivors

    return r, masked, sign_and_reveal(r, masked, story)


def _deal(r: Round, shown_to) -> tuple[dict, dict]:
    """Each node deals to the adverts it is shown (``shown_to``: node -> adverts) and masks its
    vector with every neighbour, as a shares reply carries both; a node that refuses sends nothing."""
    shared, masked = {}, {}
    for u, node in r.nodes.items():
        dealt = attempt(lambda node=node, u=u: node.share(shown_to(u), r.roster))
        if dealt is not None:
            shared[u], masked[u] = dealt, node.mask(r.vector(u))
    return shared, masked


def _routed(r: Round, u: int, shared: dict, dealers) -> dict[int, bytes]:
    """The ciphertexts a server routes to u from its neighbours among ``dealers``: the ones dealt to
    u where there are any (across sessions too, where u cannot decrypt them), random bytes else."""
    return {j: shared[j][1].get(u, os.urandom(300)) if j in shared else os.urandom(300)
            for j in r.nodes[u].peers if j in dealers}  # fmt: skip


def split_attack(n: int, k: int, rng: np.random.Generator):
    """One round against a server that targets one node v with two stories: v and t - 1 of its
    neighbours (P) are told that v's other neighbours did not deal, so that v reveals its pairwise
    seeds with them; everyone else is told that P dropped, so that they reveal P's mask keys, and
    that v survived, so that they reveal shares of v's seed. Every node is shown every signature."""
    r = make_round(n, k, seed=int(rng.integers(1 << 30)))
    r.start()
    shared, masked = _deal(r, lambda u: dict(r.adverts))
    graph = r.nodes[r.ids[0]].graph()
    v = r.ids[int(rng.integers(n))]
    # the neighbours sharing the fewest holders with v: their mask keys are easiest to collect elsewhere
    far = sorted(graph[v], key=lambda p: (len(set(graph[p]) & set(graph[v])), rng.random()))
    peers = set(far[: r.t - 1])
    told_a = [u for u in r.ids if u not in set(graph[v]) - peers]
    stories = {
        u: (told_a, told_a) if u in peers | {v} else (r.ids, [x for x in r.ids if x not in peers]) for u in r.ids
    }
    return r, masked, sign_and_reveal(r, masked, lambda u: (stories[u][0], _routed(r, u, shared, stories[u][0]),
                                                            stories[u][1]))  # fmt: skip


def plans_attack(n: int, k: int, rng: np.random.Generator):
    """One round keyed with prekeys (``secagg.node.Prekey``: signed before any plan) against a
    server that holds every node's prekey and hands each group of nodes a plan of its own (its
    own participants, and so its own quorum), shows each group the prekeys of some of its plan's
    participants, routes every ciphertext a node dealt to the holder its graph names (across
    sessions too, where it cannot decrypt) and random bytes where none was dealt, tells each
    group its own dealers and survivors, and shows every node every signature: the attack a
    plan-bound advert rules out, which a prekey does not."""
    r = make_round(n, k, seed=int(rng.integers(1 << 30)))
    prekeys = {u: Prekey.new(u, r.identities[u]) for u in r.ids}
    r.adverts = {u: p.advert for u, p in prekeys.items()}
    group = dict(zip(r.ids, rng.integers(0, int(rng.integers(1, 4)), n).tolist(), strict=True))
    stories = {}
    for g in set(group.values()):
        members = {u for u in r.ids if group[u] == g}
        parts = sorted(members | {u for u in r.ids if rng.random() < 0.6})
        shown = sorted(members | {u for u in parts if rng.random() < 0.8})
        dealers = sorted(members | {u for u in shown if rng.random() < 0.8})
        stories[g] = (dataclasses.replace(r.plan, participants=tuple(parts)), shown, dealers, rng.random(n))
    for u in r.ids:
        plan = stories[group[u]][0]
        node = attempt(lambda u=u, plan=plan: NodeRound.from_prekey(u, plan, r.roster, r.identities[u], prekeys[u]))
        if node is not None:
            r.nodes[u] = node
    shared, masked = _deal(r, lambda u: {v: r.adverts[v] for v in stories[group[u]][1]})

    def story(u):
        _, shown, dealers, draws = stories[group[u]]
        dealers = [v for v in dealers if v in shown]
        survivors = [v for i, v in enumerate(r.ids) if v == u or (v in masked and draws[i] < 0.8)]
        return dealers, _routed(r, u, shared, dealers), survivors

    return r, masked, sign_and_reveal(r, masked, story)


ATTACKS = {"groups": group_attack, "split": split_attack, "plans": plans_attack}
