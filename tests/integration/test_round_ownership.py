"""The round has one owner, the loop (``server_app.loop``): a strategy's ``configure_*`` only build
messages, from what they are given, and leave the strategy as they found it; what a round
sent is kept in its plan, and a plan dropped unsent leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedvlm.client_app.app import app as client_app
from fedvlm.methods.validation import validate
from fedvlm.protocol import FINAL_ROUND, RUN_DIR, SECURE_SUM
from fedvlm.secagg.node import Prekey
from fedvlm.secagg.roster import Identity
from fedvlm.secagg.stages import read_peer_keys
from fedvlm.spec import spec_of
from fedvlm.strategies.layers import wrap
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.secure_aggregation import SecureAggregation
from fedvlm.utils.inprocess import InProcessGrid

N = 4


class NoGrid:
    """What ``configure_*`` get for a grid: any use of it fails the test (the loop admits nodes
    before configuring; building messages needs no network)."""

    def __getattr__(self, name):
        raise AssertionError(f"configure used the grid ({name})")


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _content(messages) -> list[tuple]:
    return [
        (
            m.metadata.dst_node_id,
            {k: v.numpy().tobytes() for k, v in m.content["arrays"].items()},
            dict(m.content["config"]),
            dict(m.content[SECURE_SUM]) if SECURE_SUM in m.content else None,  # a secure round's plan
        )
        for m in messages
    ]


@pytest.mark.parametrize(
    "method", ["promptfl", "pfedmoap", "dpfpl", "fedrand", "coop", "reprogram", "promptfl-secure", "dpfpl-secure"]
)
def test_configure_builds_messages_from_its_inputs_and_changes_nothing(method, vlm_cache, pretrained_clip, tmp_path):
    method, secure = method.removesuffix("-secure"), method.endswith("-secure")
    raw = {"method": method, "cache-dir": str(vlm_cache), "output-dir": str(tmp_path), "fraction-train": 1.0}
    if method == "dpfpl":
        raw["privacy.epsilon"] = 1.0
    if method == "reprogram":  # the digits task's tiny source: the default motif source pretrains for minutes
        raw["dataset"] = "digits"
    if secure:  # the layer around the strategy: its configure_train adds the plan and keeps no state
        raw.update({"secure-aggregation.enabled": True, "replies.max-norm": 100.0})
    cfg = validate(raw)
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": N} for i in range(N)], raw)
    method_strategy = spec_of(cfg).strategy(RunParts.of(cfg))
    hooks = wrap(method_strategy)  # the layers the run's config calls for, as the ServerApp wraps it
    strategy = method_strategy  # the parts the test reads; the hooks go through the layer
    hooks.begin(grid)
    if method == "pfedmoap":  # every node in the pool: its messages carry experts
        strategy.pool = {
            n.name: np.full_like(strategy.global_arrays["ctx"], i) for i, n in enumerate(strategy.nodes.values())
        }
    hooks.admit(grid)
    if secure:  # every node's prekey on file: the plan keys the round with them, and uses up none
        hooks.sums.prekeys = {
            n.node_id: Prekey.new(n.node_id, Identity.simulated(cfg.seed, i)).advert
            for i, n in enumerate(sorted(strategy.nodes.values(), key=lambda n: n.node_id))
        }
        on_file = dict(hooks.sums.prekeys)
    before = hooks.state_dict()
    arrays = ArrayRecord({k: Array(np.ascontiguousarray(v + 1.0)) for k, v in strategy.global_arrays.items()})
    built = []
    for _ in range(2):
        train = list(hooks.configure_train(1, arrays, ConfigRecord({RUN_DIR: "/runs/x"}), NoGrid()))
        evaluate = list(
            hooks.configure_evaluate(1, arrays, ConfigRecord({RUN_DIR: "/runs/x", FINAL_ROUND: True}), NoGrid())
        )
        built.append((_content(train), _content(evaluate)))
        strategy.plans.clear()  # the round is dropped unsent (the budget's stop)
        assert _same(hooks.state_dict(), before), "configure changed the strategy's state"
        if secure:  # the protocol's state is made when the round's replies come, never by configuring
            assert isinstance(hooks, SecureAggregation) and hooks.sums.rounds == {}
            assert hooks.sums.prekeys == on_file, "configure used up the prekeys of a round never sent"
    assert built[0] == built[1]
    train, evaluate = built[0]
    assert len(train) == N and all(config[RUN_DIR] == "/runs/x" for _, _, config, _ in train)
    assert all(config[FINAL_ROUND] is True for _, _, config, _ in evaluate)
    assert all((plan is not None) == secure for *_, plan in train)
    assert all(read_peer_keys(plan).keys() == on_file.keys() for *_, plan in train if secure)
    # what was sent is the global arrays it was given, not the strategy's own copy
    given = {k: v.numpy().tobytes() for k, v in arrays.items()}
    assert any(sent.get(k) == given[k] for _, sent, _, _ in train for k in given)


@pytest.mark.parametrize(
    ("overrides", "stack"),
    [
        ({"method": "promptfl"}, ["BoundedReplies"]),
        ({"method": "dpfpl"}, ["BoundedReplies"]),  # no privacy: the server adds no noise
        ({"method": "dpfpl", "privacy__epsilon": 1.0}, ["BoundedReplies", "GlobalNoise"]),
        (
            {"method": "dpfpl", "privacy__epsilon": 1.0, "secure_aggregation__enabled": True},
            ["SecureAggregation", "BoundedReplies", "GlobalNoise"],
        ),
        ({"method": "promptfl", "privacy__epsilon": 1.0}, ["BoundedReplies"]),  # its noise is the nodes'
    ],
)
def test_the_run_config_decides_the_layers_around_a_method(make_cfg, pretrained_clip, overrides, stack):
    """Outermost first; the method's strategy itself is the same class under any of them."""
    from fedvlm.strategies.layer import Layer

    cfg = make_cfg(**overrides)
    method = spec_of(cfg).strategy(RunParts.of(cfg))
    hooks, found = wrap(method), []
    while isinstance(hooks, Layer):
        found.append(type(hooks).__name__)
        hooks = hooks.inner
    assert found == stack and hooks is method


def test_global_noise_wraps_only_a_strategy_that_steps_along_an_average(make_cfg, pretrained_clip):
    from fedvlm.strategies.global_noise import GlobalNoise

    cfg = make_cfg(method="promptfl")
    with pytest.raises(TypeError, match="no global noise can go on it"):
        GlobalNoise(spec_of(cfg).strategy(RunParts.of(cfg)))
