"""Which layers a run's strategy runs inside, innermost first, as a Flower ServerApp stacks its DP
and SecAgg+ wrappers around a strategy: one list, each layer with the run settings that call for
it. The order is the guarantee's: the global noise goes on the average of bounded updates, and
secure aggregation, outermost, takes the round's updates out of the server's sight altogether
(the nodes then bound and noise their own, under the round's plan).
"""

from __future__ import annotations

from collections.abc import Callable

from fedvlm.runconfig import RunConfig
from fedvlm.spec import spec_of
from fedvlm.strategies.base import FederatedStrategy
from fedvlm.strategies.global_noise import GlobalNoise
from fedvlm.strategies.layer import Layer
from fedvlm.strategies.reply_bound import BoundedReplies
from fedvlm.strategies.secure_aggregation import SecureAggregation

LAYERS: tuple[tuple[Callable[[RunConfig], bool], type[Layer]], ...] = (
    (lambda cfg: cfg.privacy.enabled and spec_of(cfg).global_dp is not None, GlobalNoise),
    (lambda cfg: True, BoundedReplies),  # every update, whatever else the run has
    (lambda cfg: cfg.secure_aggregation.enabled, SecureAggregation),
)


def wrap(method: FederatedStrategy) -> FederatedStrategy | Layer:
    """``method`` inside the layers its run's config calls for (``LAYERS``)."""
    hooks: FederatedStrategy | Layer = method
    for applies, layer in LAYERS:
        if applies(method.cfg):
            hooks = layer(hooks)
    return hooks
