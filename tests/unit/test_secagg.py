"""Secure aggregation's protocol on its own (``fedvlm.secagg``), every node and the server in one
process: the sum comes out exact with and without dropouts at every stage, the server's view of
one node is uniform noise, and every misbehaviour the node and server modules name is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fedvlm.secagg.graph import neighbours
from fedvlm.secagg.masks import decode, encode, expand
from fedvlm.secagg.node import NodeRound, SecAggRefused, majority_threshold
from fedvlm.secagg.server import SecAggError, ServerRound

BITS, SIZE = 32, 257


def _round(n: int, k: int | None = None, seed: int = 0):
    ids = [101 + 7 * i for i in range(n)]
    graph = neighbours(ids, n - 1 if k is None else k, np.random.default_rng(seed))
    t = majority_threshold(len(next(iter(graph.values()))) + 1)
    server = ServerRound(1, t, BITS, SIZE, graph)
    rng = np.random.default_rng(seed + 1)
    values = {u: rng.integers(-1000, 1000, SIZE) for u in ids}
    return ids, graph, t, server, values


def _run(n, k=None, drop=None, tamper=None, seed=0):
    """The whole protocol; ``drop``: stage -> nodes that stop answering before it; ``tamper``: a
    function called with (stage, node id, reply) that may return a changed reply."""
    drop, tamper = drop or {}, tamper or (lambda stage, u, r: r)
    ids, graph, t, server, values = _round(n, k, seed)
    nodes, adverts = {}, {}
    for u in ids:
        if u in drop.get("keys", ()):
            continue
        nodes[u], adverts[u] = NodeRound.start(u, 1, t, list(graph[u]), BITS)
        adverts[u] = tamper("keys", u, adverts[u])
    views = server.take_adverts(adverts)
    dealt = {}
    for u, view in views.items():
        if u not in drop.get("shares", ()):
            dealt[u] = tamper("shares", u, nodes[u].share(view))
    routed = server.take_shares(dealt)
    masked = {}
    for u, ciphertexts in routed.items():
        if u in drop.get("masked", ()):
            continue
        nodes[u].receive(ciphertexts)
        masked[u] = tamper("masked", u, nodes[u].mask(encode(values[u], BITS)))
    requests = server.take_masked(masked, {u: sorted(nodes[u].complaints) for u in masked})
    revealed = {}
    for u, (alive, gone) in requests.items():
        if u not in drop.get("unmask", ()):
            revealed[u] = tamper("unmask", u, nodes[u].reveal(alive, gone))
    total = server.unmask(revealed)
    expected = sum((values[u] for u in server.masked), np.zeros(SIZE, dtype=np.int64))
    return decode(total, BITS), expected, server, nodes


@pytest.mark.parametrize("n,k", [(5, None), (12, 6)])
def test_the_sum_is_exact_and_only_the_sum(n, k):
    got, expected, server, _ = _run(n, k)
    np.testing.assert_array_equal(got, expected)
    assert len(server.masked) == n and not server.excluded
    # what the server holds of one node is uniform modulo 2^bits, whatever the node's values
    one = next(iter(server.masked.values()))
    assert abs(float(one.mean()) / 2**BITS - 0.5) < 0.1


@pytest.mark.parametrize("stage", ["keys", "shares", "masked", "unmask"])
def test_dropouts_at_every_stage_leave_the_sum_of_the_survivors(stage):
    got, expected, server, _ = _run(7, drop={stage: [101, 108]})
    np.testing.assert_array_equal(got, expected)
    assert len(server.masked) == (7 if stage == "unmask" else 5)


def test_too_many_dropouts_fail_loudly_instead_of_releasing_a_smaller_sum():
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        _run(5, drop={"masked": [101, 108, 115]})


def _forged(share: bytes) -> bytes:
    """A share with its index kept and its value replaced by random bytes."""
    return share[:4] + os.urandom(len(share) - 4)


def test_a_forged_share_is_left_out_and_its_holder_named():
    def forge(stage, u, reply):
        if stage == "unmask" and u == 115:
            seeds, keys = reply
            return {d: _forged(s) for d, s in seeds.items()}, keys
        return reply

    got, expected, server, _ = _run(7, tamper=forge)
    np.testing.assert_array_equal(got, expected)
    assert 115 in server.forged


def test_shares_forged_past_repair_discard_the_round():
    def forge(stage, u, reply):
        if stage == "unmask" and u != 101:
            seeds, keys = reply
            return {d: _forged(s) if d == 101 else s for d, s in seeds.items()}, keys
        return reply

    with pytest.raises(SecAggError, match="cannot be rebuilt"):
        _run(5, tamper=forge)


def test_malformed_keys_and_vectors_exclude_their_sender_with_the_reason():
    def forge(stage, u, reply):
        if stage == "keys" and u == 108:
            return (b"not a key", reply[1])
        if stage == "masked" and u == 115:
            return reply[:-1]
        return reply

    got, expected, server, _ = _run(7, tamper=forge)
    np.testing.assert_array_equal(got, expected)
    assert "PEM" in server.excluded[108] and "uint64" in server.excluded[115]


def test_a_node_copying_anothers_key_is_excluded_with_its_victim_and_the_rest_go_on():
    stolen = {}

    def forge(stage, u, reply):
        if stage == "keys":
            stolen.setdefault("key", reply[1])
            return (reply[0], stolen["key"]) if u == 122 else reply
        return reply

    got, expected, server, _ = _run(7, tamper=forge)
    np.testing.assert_array_equal(got, expected)
    assert {101, 122} <= set(server.excluded)


def test_a_node_never_reveals_both_secrets_of_one_neighbour():
    ids, graph, t, server, values = _round(5)
    nodes = {}
    adverts = {}
    for u in ids:
        nodes[u], adverts[u] = NodeRound.start(u, 1, t, list(graph[u]), BITS)
    routed = server.take_shares({u: nodes[u].share(v) for u, v in server.take_adverts(adverts).items()})
    node = nodes[101]
    node.receive(routed[101])
    node.mask(encode(values[101], BITS))
    others = [u for u in ids if u != 101]
    with pytest.raises(SecAggRefused, match="both survivor and dropped"):
        node.reveal([101, *others], others[:1])
    node.reveal([101, *others[1:]], others[:1])
    with pytest.raises(SecAggRefused, match="swapped"):  # asked again, with the story changed
        node.reveal([101, *others], [])
    with pytest.raises(SecAggRefused, match="fewer than the threshold"):
        NodeRound.from_bytes(node.to_bytes()).reveal([101], others)


def test_a_node_refuses_a_threshold_two_groups_could_both_meet():
    with pytest.raises(SecAggRefused, match="strict majority"):
        NodeRound.start(1, 1, 2, [2, 3, 4], BITS)


def _garbled(victims):
    def forge(stage, u, reply):
        if stage == "shares" and u == 108:
            commitment, ciphertexts = reply
            return commitment, {h: c[:-3] + b"AAA" if h in victims else c for h, c in ciphertexts.items()}
        return reply

    return forge


def test_a_share_that_does_not_decrypt_is_kept_out_and_the_masks_still_cancel():
    got, expected, server, nodes = _run(7, tamper=_garbled({101, 115}))
    np.testing.assert_array_equal(got, expected)
    assert set(server.complaints[108]) == {101, 115} and "could not" not in str(server.report()["excluded"])


def test_a_dealer_whose_shares_nobody_can_decrypt_fails_the_round_and_is_named():
    with pytest.raises(SecAggError, match=r"node 108's seed.*could not decrypt"):
        _run(7, tamper=_garbled(set(range(200))))


def test_masks_are_reproducible_from_the_seed_and_differ_between_seeds():
    a, b = bytes(32), bytes(31) + b"\x01"
    np.testing.assert_array_equal(expand(a, 1000, 20), expand(a, 1000, 20))
    assert (expand(a, 1000, 20) != expand(b, 1000, 20)).mean() > 0.99
    assert int(expand(a, 100000, 20).max()) < 2**20


def test_signed_values_round_trip_through_the_modulus():
    v = np.array([-(2**31), -1, 0, 1, 2**31 - 1])
    np.testing.assert_array_equal(decode(encode(v, 32), 32), v)


def test_a_forger_among_many_holders_is_found_whichever_it_is():
    for forger in (101, 101 + 7 * 19):  # the first holder, whose share every first try uses, and the last

        def forge(stage, u, reply, forger=forger):
            if stage == "unmask" and u == forger:
                seeds, keys = reply
                return {d: _forged(s) for d, s in seeds.items()}, keys
            return reply

        got, expected, server, _ = _run(20, tamper=forge)
        np.testing.assert_array_equal(got, expected)
