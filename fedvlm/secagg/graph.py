"""Who shares secrets with whom in a round of secure aggregation.

SecAgg (Bonawitz et al. 2017) pairs every client with every other: each client computes n - 1
pairwise masks and deals shares to n - 1 others. SecAgg+ (Bell et al. 2020) pairs each client
with k others on a random k-regular graph, built as a Harary graph (each position joined to the
k/2 positions on either side of it on a ring) under a random relabelling, so that a client's
cost grows with k, not n.

The relabelling comes from the round's session (``secagg.node.session``: a hash of the round's
plan and of every signed key advertisement), not from a party's choice: every node recomputes the
whole graph from what it was shown, and the consistency round (``secagg.node``) makes the nodes
that unmask agree on what that was. Positions on the ring are ordered by SHA-256(session, node id)
rather than by a seeded shuffle: the same graph on every machine, whatever its NumPy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping


def degree(k: int, nodes: int) -> int:
    """A node's number of neighbours among ``nodes`` for a configured ``k`` (0: every other)."""
    return nodes - 1 if k == 0 or k >= nodes - 1 else k


def neighbours(nodes: Iterable[int], k: int, session: bytes) -> dict[int, tuple[int, ...]]:
    """Each node's neighbours: every other node when ``degree(k)`` reaches them all, else the
    Harary graph of even degree ``k`` on the ring ``session`` orders."""
    nodes = list(nodes)
    n = len(nodes)
    if len(set(nodes)) != n:
        raise ValueError("a node appears twice among the round's participants")
    if degree(k, n) == n - 1:
        return {u: tuple(sorted(v for v in nodes if v != u)) for u in nodes}
    if k < 2 or k % 2:
        raise ValueError(f"a SecAgg+ graph needs an even degree of at least 2, got {k}")
    ring = sorted(nodes, key=lambda u: hashlib.sha256(session + int(u).to_bytes(8, "big")).digest())
    half = k // 2
    return {u: tuple(sorted({ring[(i + d) % n] for d in range(-half, half + 1) if d})) for i, u in enumerate(ring)}


def reach(graph: Mapping[int, Iterable[int]], start: int, members: set[int]) -> set[int]:
    """The members ``start`` reaches in ``graph`` through members only."""
    seen, todo = {start}, [start]
    while todo:
        for v in graph.get(todo.pop(), ()):
            if v in members and v not in seen:
                seen.add(v)
                todo.append(v)
    return seen


def connected(graph: Mapping[int, Iterable[int]], members: Iterable[int]) -> bool:
    """Whether ``members`` form one connected piece of ``graph`` (edges among them only)."""
    members = set(members)
    return bool(members) and reach(graph, next(iter(members)), members) == members
