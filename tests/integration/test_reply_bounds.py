"""The server's bound on hostile replies never changes the sensitivity of what it noises.

Neighbouring datasets: one record of client 1 present (D) or absent (D'). Its clipped per-sample
gradient (norm <= C) enters client 1's upload as g_x / B. Under global DP the ledger assumes that
this moves the average the server noises by at most C / (N B), whatever the other clients send.
A bound computed from the round's replies (a ratio of their median) broke that: changing client 1's
record moved the median, which moved how much client 2's large update was clipped (measured 8x
the assumed sensitivity). Every ``replies.*`` setting is tried here on the real strategy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedvlm.metrics import NUM_EXAMPLES
from fedvlm.protocol import TrainReply
from fedvlm.spec import spec_of
from fedvlm.strategies.nodes import NodeInfo
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import Outgoing, Payload, PhasePlan, RoundPlan
from fedvlm.strategies.records import ClientUpdate
from fedvlm.strategies.reply_bound import BoundedReplies
from fedvlm.tensor_names import GLOBAL_GRAD

C, B, N = 10.0, 32, 3
SETTINGS = [
    {"replies.norm-ratio": ratio, "replies.max-norm": absolute, "replies.norm-action": action}
    for ratio, absolute, action in itertools.product((10.0, 2.0, 0.0), (0.0, 1.0, 5.0), ("clip", "reject"))
]


def _strategy(make_cfg, **replies):
    cfg = make_cfg(
        method="dpfpl",
        privacy__epsilon=1.0,
        privacy__clip=C,
        prompt__batch_size=B,
        num_server_rounds=3,
        **{k.replace(".", "__").replace("-", "_"): v for k, v in replies.items()},
    )
    strategy = spec_of(cfg).strategy(RunParts.of(cfg))
    for i in range(N):
        strategy.registry.nodes[1000 + i] = NodeInfo(1000 + i, f"client-{i}", i, 200, 50, 0, "fp", 40)
    strategy.prepare()
    return strategy


def _sent(strategy) -> PhasePlan:
    """Round 1's train phase, as if every node had been sent the zero prompt."""
    kept = PhasePlan("train", 1)
    for n in strategy.nodes.values():
        kept.outgoing[n.node_id] = Outgoing(n, Payload({"global_ctx": strategy.global_arrays["global_ctx"]}))
    strategy.plans[1] = RoundPlan(1, train=kept)
    return kept


def _clip(g: np.ndarray) -> np.ndarray:
    """What an honest client does last: clip its upload to C."""
    return (g * min(1.0, C / np.linalg.norm(g))).astype(np.float32)


def _average(strategy, uploads: list[np.ndarray]) -> np.ndarray:
    nodes = list(strategy.nodes.values())
    updates = [
        ClientUpdate(n, TrainReply({GLOBAL_GRAD: u}, {NUM_EXAMPLES: 32})) for n, u in zip(nodes, uploads, strict=True)
    ]
    return strategy.mean(1, BoundedReplies(strategy).bound(updates, _sent(strategy)))


# (client 0's norm, client 1's norm without the record, client 2's norm): the audit's table and
# worse: a small median that the changed record decides, and a large honest update that it clips
CASES = [(0.1, 0.0375, 6.0), (0.5, 0.3, 9.0), (3.0, 3.7, 6.0), (0.01, 0.0, 9.99), (1.0, 1.0, 10.0)]


@pytest.mark.parametrize("replies", SETTINGS, ids=lambda r: "-".join(str(v) for v in r.values()))
def test_one_record_moves_the_pre_noise_average_by_at_most_c_over_nb(make_cfg, pretrained_clip, replies):
    strategy = _strategy(make_cfg, **replies)
    rng = np.random.default_rng(0)
    shape = (4, 8)
    sensitivity = C / (N * B)
    worst = 0.0
    for norms in CASES:
        directions = [v / np.linalg.norm(v) for v in rng.normal(size=(3, *shape))]
        record = directions[1] * C  # the record's clipped gradient, at the clip norm, along client 1's upload
        sums = [d * n + rng.normal(0, 1e-3, shape) for d, n in zip(directions, norms, strict=True)]
        without = [_clip(s) for s in sums]
        with_record = [*without[:1], _clip(sums[1] + record / B), *without[2:]]
        moved = float(np.linalg.norm(_average(strategy, with_record) - _average(strategy, without)))
        worst = max(worst, moved)
    assert worst <= sensitivity * (1 + 1e-4), (worst, sensitivity)
    assert worst > 0.9 * sensitivity  # the record did move it: the check can fail


def test_the_server_noised_tensor_is_bounded_at_the_clip_norm_and_the_ledger_says_why(make_cfg, pretrained_clip):
    strategy = _strategy(make_cfg, **{"replies.norm-ratio": 2.0, "replies.max-norm": 1.0})
    layer = BoundedReplies(strategy)
    layer.note_bounds()  # as the layer does once the run has begun
    bounds = strategy.ledger.as_dict()["reply_bounds"]
    fixed = next(b for b in bounds if b["tensors"] == ["global_grad"])
    assert fixed["bound"] == C and fixed["rule"] == "fixed at privacy.clip" and "C/(N*B)" in fixed["why"]
    # an honest upload at the clip norm passes untouched; a forged one is clipped to C, not to the median rule
    nodes = list(strategy.nodes.values())
    honest = np.full((4, 8), C / np.sqrt(32), np.float32)
    forged = np.full((4, 8), 1e3, np.float32)
    small = np.full((4, 8), 1e-3, np.float32)
    updates = [
        ClientUpdate(n, TrainReply({GLOBAL_GRAD: u}, {NUM_EXAMPLES: 32}))
        for n, u in zip(nodes, [small, honest, forged], strict=True)
    ]
    phase = _sent(strategy)
    kept = layer.bound(updates, phase)
    assert [np.linalg.norm(u.reply.arrays[GLOBAL_GRAD]) for u in kept] == pytest.approx(
        [np.linalg.norm(small), C, C], rel=1e-5
    )
    assert [b["client"] for b in phase.bounded] == ["client-2"]


def test_without_server_noise_the_relative_rule_still_applies(make_cfg, pretrained_clip):
    cfg = make_cfg(method="promptfl", privacy__epsilon=1.0, **{"replies__norm_ratio": 2.0})
    strategy = spec_of(cfg).strategy(RunParts.of(cfg))
    strategy.registry.nodes = {i: NodeInfo(i, f"c{i}", i, 64, 24, 0, "x", 40) for i in range(N)}
    strategy.prepare()
    assert [b.tensors for b in BoundedReplies(strategy).bounds()] == [
        None
    ]  # PromptFL's uploads are noised by their sender
