"""Shamir's secret sharing of a short secret (a seed, a key's scalar) as one element of the prime
field of p = 2**521 - 1.

Each node shares its self-mask seed and its mask key's scalar with every neighbour, and the server
combines the shares of every survivor and every dropped node: at 20 nodes and a threshold of 11,
Flower's ``create_shares`` (PyCryptodome's GF(2^128) arithmetic, written in Python, one field
element per 16 bytes, a thread pool per call) made sharing and combining most of the protocol's
Python cost (``bench.secure_aggregation protocol``). Here a secret of up to ``MOST_BYTES`` bytes
is one field element and the arithmetic is Python's own integers (C), with the same threshold
property: any ``threshold`` shares give the secret, fewer give no information about it, since the
other coefficients are drawn uniformly from the field (``secrets``).

A share is ``SHARE_BYTES`` long: its point x (1..holders, 2 bytes) and f(x) (66 bytes). Combining
refuses malformed shares, points repeated or at 0, and values outside the field. As with any
Shamir sharing, wrong shares combine to a wrong secret rather than an error: the caller checks
what it gets against a commitment (the seed) or a public key (the mask key).
"""

from __future__ import annotations

import secrets as random

P = (1 << 521) - 1  # a Mersenne prime: every secret of up to 64 bytes, with its marker byte, is below it
MOST_BYTES = 64
X_BYTES, Y_BYTES = 2, 66
SHARE_BYTES = X_BYTES + Y_BYTES


def split(secret: bytes, threshold: int, holders: int) -> list[bytes]:
    """``holders`` shares of ``secret``, any ``threshold`` of which give it back."""
    if not 1 <= threshold <= holders < 1 << (8 * X_BYTES):
        raise ValueError(f"need 1 <= threshold <= holders < 65536; got {threshold} and {holders}")
    if len(secret) > MOST_BYTES:
        raise ValueError(f"a secret of {len(secret)} bytes; at most {MOST_BYTES}")
    value = int.from_bytes(b"\x01" + secret, "big")  # the marker keeps the secret's leading zero bytes
    coefficients = [value] + [random.randbelow(P) for _ in range(threshold - 1)]
    shares = []
    for x in range(1, holders + 1):
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % P
        shares.append(x.to_bytes(X_BYTES, "big") + y.to_bytes(Y_BYTES, "big"))
    return shares


def _points(shares: list[bytes]) -> list[tuple[int, int]]:
    points = []
    for share in shares:
        if not isinstance(share, bytes) or len(share) != SHARE_BYTES:
            raise ValueError(f"a share is not {SHARE_BYTES} bytes")
        x, y = int.from_bytes(share[:X_BYTES], "big"), int.from_bytes(share[X_BYTES:], "big")
        if x == 0 or y >= P:
            raise ValueError("a share lies outside the field or at x = 0")
        points.append((x, y))
    if len({x for x, _ in points}) != len(points):
        raise ValueError("two shares are for the same point")
    return points


def combine(shares: list[bytes]) -> bytes:
    """The secret the shares give (Lagrange's interpolation at 0); ``ValueError`` when they are
    malformed or give no secret of this sharing's form."""
    points = _points(shares)
    if not points:
        raise ValueError("no shares")
    value = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num, den = num * xj % P, den * (xj - xi) % P
        value = (value + yi * num * pow(den, -1, P)) % P
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    if not raw or raw[0] != 1 or len(raw) > MOST_BYTES + 1:
        raise ValueError("the shares give no secret")
    return raw[1:]
