"""Secure aggregation's protocol on its own (``fedvlm.secagg``), every node and the server in one
process (``tests/secagg_harness``): the sum comes out exact with and without dropouts at every
stage, the server's view of one node is uniform noise, and every misbehaviour of a node that the
server module names is left out or refused. What a server that deviates gets is
``test_secagg_malicious``'s."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fedvlm.secagg.masks import decode, encode, expand
from fedvlm.secagg.node import PREKEYED, SecAggRefused
from fedvlm.secagg.server import SecAggError, ServerRound
from fedvlm.secagg.stages import Advert
from tests.secagg_harness import BITS, SIZE, make_round, run_honest


@pytest.mark.parametrize("prekeyed", [False, True])
@pytest.mark.parametrize("n,k", [(5, 0), (12, 6)])
def test_the_sum_is_exact_and_only_the_sum(n, k, prekeyed):
    got, expected, server, _ = run_honest(n, k, prekeyed=prekeyed)
    np.testing.assert_array_equal(got, expected)
    assert len(server.masked) == n and len(server.signatures) == n and not server.excluded
    # what the server holds of one node is uniform modulo 2^bits, whatever the node's values
    one = next(iter(server.masked.values()))
    assert abs(float(one.mean()) / 2**BITS - 0.5) < 0.1


@pytest.mark.parametrize("prekeyed", [False, True])
@pytest.mark.parametrize("stage", ["keys", "shares", "consistency", "unmask"])
def test_dropouts_at_every_stage_leave_the_sum_of_the_survivors(stage, prekeyed):
    got, expected, server, _ = run_honest(7, drop={stage: [101, 108]}, prekeyed=prekeyed)
    np.testing.assert_array_equal(got, expected)
    assert len(server.masked) == (7 if stage in ("consistency", "unmask") else 5)


def test_a_neighbour_that_never_dealt_is_unmasked_with_the_survivors_own_seeds_and_nothing_else():
    """A node that drops before it deals (its shares and masked vector are one reply) leaves its
    pairwise masks in its neighbours' vectors; each survivor returns its own seed with it, and
    only once the story that says it never dealt is signed. A survivor that then drops too
    leaves a mask nobody can remove: the round fails rather than release a wrong sum."""
    got, expected, server, r = run_honest(7, k=4, drop={"shares": [101]})
    np.testing.assert_array_equal(got, expected)
    neighbours = set(r.nodes[108].graph()[101])
    assert {u for u in server.revealers if u in neighbours} == neighbours
    assert server.masked.keys() == set(r.ids) - {101}
    # every node a neighbour of every other (k = 0): 108 drops at the unmasking, its seed with 101 with it
    with pytest.raises(SecAggError, match="node 108 did not return its pairwise seed with node 101"):
        run_honest(7, drop={"shares": [101], "unmask": [108]})


def test_too_many_dropouts_fail_loudly_instead_of_releasing_a_smaller_sum():
    with pytest.raises(SecAggError, match="fewer than"):
        run_honest(5, drop={"shares": [101, 108, 115]})
    # the survivors hold the threshold, but fewer than a majority of the participants sign
    with pytest.raises(SecAggError, match="fewer than the 4"):
        run_honest(7, drop={"consistency": [101, 108, 115, 122]})


def _forged(share: bytes) -> bytes:
    """A share with its index kept and its value replaced by random bytes."""
    return share[:4] + os.urandom(len(share) - 4)


def test_a_forged_share_is_left_out_and_its_holder_named():
    def forge(stage, u, reply):
        if stage == "unmask" and u == 115:
            seeds, keys, pairs = reply
            return {d: _forged(s) for d, s in seeds.items()}, keys, pairs
        return reply

    got, expected, server, _ = run_honest(7, tamper=forge)
    np.testing.assert_array_equal(got, expected)
    assert 115 in server.forged


def test_shares_forged_past_repair_discard_the_round():
    def forge(stage, u, reply):
        if stage == "unmask" and u != 101:
            seeds, keys, pairs = reply
            return {d: _forged(s) if d == 101 else s for d, s in seeds.items()}, keys, pairs
        return reply

    with pytest.raises(SecAggError, match="cannot be rebuilt"):
        run_honest(5, tamper=forge)


def test_malformed_keys_vectors_and_signatures_exclude_their_sender_with_the_reason():
    def forge(stage, u, reply):
        if stage == "keys" and u == 108:
            return Advert(b"not a key", reply.mask, reply.identity, reply.signature)
        if stage == "shares" and u == 115:
            return reply[0], reply[1], reply[2][:-1]
        if stage == "consistency" and u == 129:
            return bytes(64), reply[1]
        return reply

    got, expected, server, _ = run_honest(7, tamper=forge)
    np.testing.assert_array_equal(got, expected)
    assert "X25519" in server.excluded[108] and "uint64" in server.excluded[115]
    assert "does not verify" in server.excluded[129]


def test_a_key_of_small_order_is_refused_by_the_server_and_by_every_node():
    """X25519 agrees an all-zero secret with a point of small order, which anyone knows: such a
    key would make a pairwise mask public. The server excludes its sender, and a node shown one
    by a server that relays it anyway refuses the round."""
    from fedvlm.secagg.node import SecAggRefused

    def forge(stage, u, reply):
        if stage == "keys" and u == 108:
            return Advert(reply.encryption, bytes(32), reply.identity, reply.signature)
        return reply

    got, expected, server, _ = run_honest(7, tamper=forge)
    np.testing.assert_array_equal(got, expected)
    assert "of full order" in server.excluded[108]
    from fedvlm.secagg.node import advert_message

    r = make_round(5)
    r.start(r.ids)
    shown, bad = dict(r.adverts), r.ids[1]  # a member signs a key of small order (a colluding member)
    signed = r.identities[bad].sign(advert_message(r.plan.digest, bad, bytes(32), shown[bad].mask))
    shown[bad] = Advert(bytes(32), shown[bad].mask, shown[bad].identity, signed)
    with pytest.raises(SecAggRefused, match="full order"):
        r.nodes[r.ids[0]].share(shown, r.roster)


def test_a_key_is_accepted_in_its_one_encoding_only():
    """X25519 reads the top bit as zero and u + p as u: the same point under other bytes would
    pass the check that no two advertised keys are equal."""
    from fedvlm.secagg.node import X25519_P, agree, new_key, usable_key

    mine, theirs = new_key(), new_key()
    flipped = theirs[1][:31] + bytes([theirs[1][31] | 0x80])
    assert agree(mine[0], flipped) == agree(mine[0], theirs[1])  # what the check stops
    assert usable_key(theirs[1]) and not usable_key(flipped)
    assert not usable_key((X25519_P + 9).to_bytes(32, "little"))  # 9, the base point, written as 9 + p
    assert not usable_key(theirs[1][:31]) and not usable_key("text")


def test_a_node_copying_anothers_key_or_advert_is_excluded_and_the_rest_go_on():
    stolen = {}

    def forge(stage, u, reply):
        if stage == "keys":
            stolen.setdefault("advert", reply)
            if u == 122:  # another node's mask key: its own signature does not cover it
                return Advert(reply.encryption, stolen["advert"].mask, reply.identity, reply.signature)
            if u == 129:  # another node's whole advert, under its own id: the signature binds the id
                return stolen["advert"]
        return reply

    got, expected, server, _ = run_honest(7, tamper=forge)
    np.testing.assert_array_equal(got, expected)
    assert "signature" in server.excluded[122] and "signature" in server.excluded[129]
    assert 101 not in server.excluded  # the victim's own advert still stands


def test_shares_of_nodes_a_holder_holds_none_of_cost_that_holder_only():
    def forge(stage, u, reply):
        if stage == "unmask" and u == 115:
            seeds, keys, pairs = reply
            return seeds, {**keys, 101: next(iter(seeds.values()))}, pairs  # a key share of a survivor
        return reply

    got, expected, server, _ = run_honest(7, tamper=forge)
    np.testing.assert_array_equal(got, expected)
    assert "holds none of" in server.excluded[115]


def _garbled(victims):
    def forge(stage, u, reply):
        if stage == "shares" and u == 108:
            commitment, ciphertexts, masked = reply
            garbled = {h: c[:-3] + b"AAA" if h in victims else c for h, c in ciphertexts.items()}
            return commitment, garbled, masked
        return reply

    return forge


def test_a_share_that_does_not_decrypt_is_kept_out_and_the_masks_still_cancel():
    got, expected, server, nodes = run_honest(7, tamper=_garbled({101, 115}))
    np.testing.assert_array_equal(got, expected)
    assert set(server.complaints[108]) == {101, 115} and "could not" not in str(server.report()["excluded"])


def test_a_dealer_whose_shares_nobody_can_decrypt_fails_the_round_and_is_named():
    with pytest.raises(SecAggError, match=r"node 108's seed.*could not decrypt"):
        run_honest(7, tamper=_garbled(set(range(200))))


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
                seeds, keys, pairs = reply
                return {d: _forged(s) for d, s in seeds.items()}, keys, pairs
            return reply

        got, expected, server, _ = run_honest(20, tamper=forge)
        np.testing.assert_array_equal(got, expected)


def test_a_prekey_and_an_advert_are_not_interchangeable():
    """A prekey is signed over ``PREKEYED``, an advert over its plan's digest: neither passes for
    the other, at the server and at every node, so keys made for one round's plan are never used
    as a prekey, nor a prekey where the plan's own signature is due."""
    for prekeyed in (False, True):
        r = make_round(5)
        r.start(prekeyed=prekeyed)
        server = ServerRound(r.plan, SIZE, r.roster)
        with pytest.raises(SecAggError, match="0 nodes advertised keys"):
            server.take_adverts(dict(r.adverts), b"" if prekeyed else PREKEYED)  # the other kind's check
        assert len(server.excluded) == 5 and all("signature" in w for w in server.excluded.values())
        other = make_round(5)
        other.start(prekeyed=not prekeyed)
        with pytest.raises(SecAggRefused, match="signature over this round's plan"):
            r.nodes[101].share({u: other.adverts[u] if u != 101 else r.adverts[u] for u in r.ids}, r.roster)
