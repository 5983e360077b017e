"""Shamir sharing of a seed or a key's scalar (``secagg.shamir``): any ``threshold`` shares give the
secret back, leading zero bytes included; fewer give another value; hostile shares are refused by
form, and a forged value combines to a wrong secret that the caller's check catches."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedvlm.secagg import shamir


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=shamir.MOST_BYTES), st.integers(1, 12), st.integers(0, 8), st.randoms())
def test_any_threshold_shares_give_the_secret_back(secret, threshold, extra, rnd):
    holders = threshold + extra
    shares = shamir.split(secret, threshold, holders)
    assert len(shares) == holders and all(len(s) == shamir.SHARE_BYTES for s in shares)
    assert shamir.combine(rnd.sample(shares, threshold)) == secret
    assert shamir.combine(shares) == secret  # more than enough, all honest


def test_fewer_than_the_threshold_give_another_value():
    secret = bytes(16) + b"seed"
    shares = shamir.split(secret, 5, 9)
    for subset in itertools.islice(itertools.combinations(shares, 4), 40):
        try:
            assert shamir.combine(list(subset)) != secret
        except ValueError:  # most such values are not even of the sharing's form
            pass


def test_the_same_secret_is_shared_afresh_each_time():
    assert shamir.split(b"k" * 48, 3, 5) != shamir.split(b"k" * 48, 3, 5)


@pytest.mark.parametrize(
    ("forge", "why"),
    [
        (lambda s: s[:-1], "not 68 bytes"),
        (lambda s: b"\x00\x00" + s[2:], "x = 0"),
        (lambda s: s[:2] + (shamir.P).to_bytes(66, "big"), "outside the field"),
        (lambda s: "text", "not 68 bytes"),
    ],
)
def test_malformed_shares_are_refused(forge, why):
    shares = shamir.split(b"secret", 2, 3)
    with pytest.raises(ValueError, match=why):
        shamir.combine([forge(shares[0]), shares[1]])
    with pytest.raises(ValueError, match="same point"):
        shamir.combine([shares[0], shares[0]])
    with pytest.raises(ValueError, match="no shares"):
        shamir.combine([])


def test_a_forged_value_gives_a_wrong_secret_not_the_true_one():
    secret = random.randbytes(32)
    shares = shamir.split(secret, 3, 4)
    forged = shares[0][:2] + ((int.from_bytes(shares[0][2:], "big") + 1) % shamir.P).to_bytes(66, "big")
    try:
        assert shamir.combine([forged, *shares[1:3]]) != secret
    except ValueError:
        pass
    assert shamir.combine(shares[1:]) == secret  # the honest three still give it


@pytest.mark.parametrize(("threshold", "holders", "size"), [(0, 3, 8), (4, 3, 8), (2, 3, shamir.MOST_BYTES + 1)])
def test_a_sharing_it_cannot_make_is_refused(threshold, holders, size):
    with pytest.raises(ValueError):
        shamir.split(bytes(size), threshold, holders)
