"""The masks of secure aggregation: vectors over the integers modulo 2^bits, expanded from a
32-byte seed, and the modular arithmetic they live in.

The expansion is ChaCha20's keystream (``cryptography``, OpenSSL's implementation) under a key
derived from the seed with HKDF-SHA256: a stream cipher keyed with a uniform secret is a
pseudorandom generator, so a mask is indistinguishable from uniform to whoever lacks the seed.
Flower's ``secaggplus_utils.pseudo_rand_gen`` is not used: it folds the seed into 32 bits and
seeds NumPy's Mersenne Twister with them, so anyone can recover a mask by trying 2^32 seeds.
Each seed masks one vector (every key pair and self-mask seed is fresh each round), so the
fixed nonce is never reused under one key.

A power-of-two modulus keeps the reduction of a uniform 64-bit word unbiased (its low bits),
and lets uint64 arithmetic wrap on its own: every sum is reduced with ``reduce``.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SEED_BYTES = 32
MAX_BITS = 62  # a sum of a few thousand masked vectors must not overflow uint64 before reduction
_INFO = b"fedvlm secure aggregation mask"
_NONCE = bytes(16)


def modulus(bits: int) -> int:
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"secure aggregation works modulo 2^bits with 1 <= bits <= {MAX_BITS}, got bits = {bits}")
    return 1 << bits


def wire_dtype(bits: int) -> type[np.unsignedinteger]:
    """How residues modulo 2^bits travel: in 4 bytes where they fit, else 8."""
    return np.uint32 if bits <= 32 else np.uint64


def expand(seed: bytes, size: int, bits: int) -> np.ndarray:
    """``size`` uniform integers modulo 2^``bits`` (uint64) from ``seed``."""
    if len(seed) < SEED_BYTES:
        raise ValueError(f"a mask seed must hold at least {SEED_BYTES} bytes, got {len(seed)}")
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(seed)
    stream = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor().update(bytes(8 * size))
    return reduce(np.frombuffer(stream, dtype=np.uint64).copy(), bits)


def reduce(vector: np.ndarray, bits: int) -> np.ndarray:
    """``vector`` (uint64) modulo 2^``bits``."""
    return vector & np.uint64(modulus(bits) - 1)


def encode(values: np.ndarray, bits: int) -> np.ndarray:
    """Signed integers as residues modulo 2^``bits`` (two's complement)."""
    return reduce(np.asarray(values, dtype=np.int64).astype(np.uint64), bits)


def decode(residues: np.ndarray, bits: int) -> np.ndarray:
    """Residues modulo 2^``bits`` back to the signed integers in [-2^(bits-1), 2^(bits-1))."""
    half = np.uint64(modulus(bits) >> 1)
    r = reduce(np.asarray(residues, dtype=np.uint64), bits)
    return r.astype(np.int64) - np.where(r >= half, np.int64(modulus(bits)), np.int64(0))
