"""The server's global mechanism as a layer around the method's strategy, as Flower's server-side
DP wrapper adds its noise around its strategy's aggregate: DP-FPL's N(0, sigma_G^2), added once a
round to the average of the bounded uploads (``strategies.reply_bound``: at the clip C, so one
record moves that average by at most C / (N B)) before the strategy's server step takes it.

The strategy inside (``GlobalGradientStrategy``, DP-FPL's family) never knows the noise: it gives
the average (``mean``) and takes a step along what it is handed (``step``). Under secure
aggregation the clients draw the same noise in shares (``privacy.distributed``) and the server
only sees their noised sum; this layer then adds nothing and reports the noise the shares add
up to. Why the accounting holds: the mechanism released is exactly the one the planner accounted
(``privacy.budget.RunBudget.release_global``: its sigma, its denominator, its noise source, the
added noise checked before release), and it is the only path from the uploads to the model.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord

from fedvlm.metrics import GDP_DENOMINATOR, GDP_SIGMA
from fedvlm.privacy.accounting import BudgetError
from fedvlm.strategies.base import FederatedStrategy
from fedvlm.strategies.layer import Layer
from fedvlm.strategies.records import ClientUpdate, RoundSum
from fedvlm.utils.rng import ServerStream, server_key


@runtime_checkable
class Averaged(Protocol):
    """A strategy whose round is one step along the average of its uploads."""

    def denominator(self, server_round: int, count: int) -> int: ...
    def mean(self, server_round: int, updates: list[ClientUpdate]) -> np.ndarray: ...
    def step(self, grad: torch.Tensor) -> None: ...


class GlobalNoise(Layer):
    """``method`` with the run's global noise on its average (the module docstring)."""

    def __init__(self, method: FederatedStrategy | Layer):
        if not isinstance(method, Averaged):
            raise TypeError(f"{type(method).__name__} takes no step along an average: no global noise can go on it")
        super().__init__(method)
        self.method = method

    def aggregate_updates(
        self, server_round: int, updates: list[ClientUpdate]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if not updates:  # nothing came: nothing is released, the prompt stays
            return self.inner.aggregate_updates(server_round, updates)
        parts = self.parts
        mean = torch.from_numpy(self.method.mean(server_round, updates).astype(np.float32))
        key = server_key(parts.cfg.seed, server_round, ServerStream.GLOBAL_NOISE)
        released = parts.budget.release_global(mean, key, parts.registry.noise_sources())
        if released is None:  # fails closed: a run planned without its server mechanism releases nothing
            raise BudgetError("the run's global noise was not planned: no average is released without it")
        grad, sigma = released
        self.method.step(grad)
        metrics = {GDP_SIGMA: sigma, GDP_DENOMINATOR: self.method.denominator(server_round, len(updates))}
        return self.train_result(parts.phase(server_round, "train"), updates, metrics)

    def aggregate_sums(self, server_round: int, total: RoundSum, updates: list[ClientUpdate]) -> dict[str, float]:
        metrics = self.inner.aggregate_sums(server_round, total, updates)
        noise = self.parts.budget.distributed_noise()
        if noise is not None:  # what the survivors' shares add up to, on the mean
            n = self.method.denominator(server_round, len(total.survivors))
            metrics = {**metrics, GDP_SIGMA: noise.gamma * noise.client_sigma * len(total.survivors) ** 0.5 / n}
            metrics[GDP_DENOMINATOR] = n
        return metrics
