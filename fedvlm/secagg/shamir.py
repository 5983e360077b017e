"""Shamir secret sharing of byte strings: PyCryptodome's ``Shamir`` over GF(2^128), one 16-byte
block at a time, in the share format of Flower's ``secure_aggregation.crypto.shamir`` (a 4-byte
little-endian index, then each block's share; the secret PKCS#7-padded to whole blocks).

Flower's functions do the same through a fresh thread pool per call; starting its threads cost
0.9 of the 1.6 s a 20-node round of the whole protocol took in one process (cProfile, 2-core CPU,
docs/results/secure-aggregation.md), for blocks that take microseconds each.
"""

from __future__ import annotations

from Crypto.Protocol.SecretSharing import Shamir
from Crypto.Util.Padding import pad, unpad

BLOCK = 16


def create_shares(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """``num`` shares of ``secret``, any ``threshold`` of which rebuild it."""
    padded = pad(secret, BLOCK)
    shares = [bytearray(i.to_bytes(4, "little")) for i in range(1, num + 1)]
    for at in range(0, len(padded), BLOCK):
        for index, share in Shamir.split(threshold, num, padded[at : at + BLOCK], ssss=False):
            shares[index - 1] += share
    return [bytes(s) for s in shares]


def combine_shares(shares: list[bytes]) -> bytes:
    """The secret ``shares`` (at least the threshold of them) rebuild; ``ValueError`` when they
    do not rebuild a padded secret."""
    if not shares or any(len(s) != len(shares[0]) or (len(s) - 4) % BLOCK for s in shares):
        raise ValueError("shares of different lengths, or not whole blocks")
    indices = [int.from_bytes(s[:4], "little") for s in shares]
    padded = b"".join(
        Shamir.combine([(i, s[at : at + BLOCK]) for i, s in zip(indices, shares, strict=True)], ssss=False)
        for at in range(4, len(shares[0]), BLOCK)
    )
    return unpad(padded, BLOCK)
