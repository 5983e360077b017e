"""Who shares secrets with whom in a round of secure aggregation.

SecAgg (Bonawitz et al. 2017) pairs every client with every other: each client computes n - 1
pairwise masks and deals shares to n - 1 others. SecAgg+ (Bell et al. 2020) pairs each client
with k others on a random k-regular graph, built as a Harary graph (each position joined to the
k/2 positions on either side of it on a ring) under a random relabelling, so that a client's
cost grows with k, not n, and whom it is paired with is not up to it.
"""

from __future__ import annotations

import numpy as np


def neighbours(nodes: list[int], k: int, rng: np.random.Generator) -> dict[int, tuple[int, ...]]:
    """Each node's neighbours: every other node when ``k`` >= len(nodes) - 1, else a random
    Harary graph of even degree ``k``."""
    n = len(nodes)
    if len(set(nodes)) != n:
        raise ValueError("a node appears twice among the round's participants")
    if k >= n - 1:
        return {u: tuple(sorted(v for v in nodes if v != u)) for u in nodes}
    if k < 2 or k % 2:
        raise ValueError(f"a SecAgg+ graph needs an even degree of at least 2, got {k}")
    ring = [nodes[i] for i in rng.permutation(n)]
    half = k // 2
    return {u: tuple(sorted({ring[(i + d) % n] for d in range(-half, half + 1) if d})) for i, u in enumerate(ring)}
