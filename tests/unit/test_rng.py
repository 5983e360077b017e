"""Named random streams (fedvlm/utils/rng.py): no two draws of a run share a key."""

from __future__ import annotations

import itertools

from fedvlm.utils.rng import NodeStream, ServerStream, name_key, node_key, node_seed, server_key


def test_no_two_draws_of_a_run_share_a_key():
    """Every server and node stream of rounds 1-3, nodes 1-12 and the once-per-node draws: all
    keys distinct. Without the domain tag, FedRand's draw for node 5 (server stream 11, extra 5)
    had the key of node 11's batch sampling (node stream 5) in the same round."""
    draws = {}
    for r in range(1, 4):
        for s in ServerStream:
            per_node = (ServerStream.FEDRAND_HALF, ServerStream.PFEDMOAP_EXPERTS)
            extras = [(n,) for n in range(1, 13)] if s in per_node else [()]
            for extra in extras:
                draws.setdefault(tuple(server_key(0, r, s, *extra)), []).append(("server", r, s, extra))
    for r, n, s in itertools.product(range(0, 4), range(1, 13), NodeStream):
        draws.setdefault(tuple(node_key(0, n, s, r)), []).append(("node", r, n, s))
    shared = {k: v for k, v in draws.items() if len(v) > 1}
    assert not shared, shared
    assert len(draws) == 3 * (len(ServerStream) - 2 + 2 * 12) + 4 * 12 * len(NodeStream)


def test_node_seed_uses_the_partition_else_the_whole_name():
    assert node_seed(3, "anything") == 4
    # two organisations' folder nodes whose names share a long prefix still get different seeds
    a, b = "hospital-network-berlin-01", "hospital-network-berlin-02"
    assert node_seed(-1, a) != node_seed(-1, b)
    assert node_seed(-1, a) == name_key(a) and 0 <= name_key(a) < 2**63
