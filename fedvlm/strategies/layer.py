"""What every feature around a method's strategy is built on: a ``Layer`` hands each hook to the
strategy (or the layer) it wraps unless it overrides it, as Flower's DP wrappers and SecAgg+
workflow do. A method's strategy never knows which layers run around it
(``strategies.layers``: which ones a run gets, in which order).

Besides the loop's hooks (``server_app.loop.HOOKS``) a layer reaches the strategy inside it only
through the four steps of a round's training that ``FederatedStrategy`` makes public:
``validate`` (the replies that count), ``aggregate_updates`` (fold them in), ``aggregate_sums``
(fold in a sum in their place) and ``train_result`` (the round's outcome).
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedvlm.strategies.base import FederatedStrategy
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import PhasePlan
from fedvlm.strategies.records import ClientUpdate, RoundSum, RunOutputs


class Layer:
    """``inner`` (a method's strategy, or another layer around one), every hook passed on."""

    def __init__(self, inner: FederatedStrategy | Layer):
        self.inner = inner

    @property
    def parts(self) -> RunParts:
        return self.inner.parts

    @property
    def sum_weighted(self) -> bool:
        return self.inner.sum_weighted

    # ---- the loop's hooks -------------------------------------------------------------------------
    def begin(self, grid: Grid, resumed: dict | None = None) -> None:
        self.inner.begin(grid, resumed)

    def admit(self, grid: Grid) -> None:
        self.inner.admit(grid)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_train(server_round, arrays, config, grid)

    def next_stage(self, server_round: int, replies: Iterable[Message]) -> Iterable[Message]:
        return self.inner.next_stage(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.aggregate_updates(server_round, self.validate(replies, self.parts.phase(server_round, "train")))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def num_rounds(self) -> int:
        return self.inner.num_rounds()

    def outputs(self, rounds: list[dict]) -> RunOutputs:
        return self.inner.outputs(rounds)

    # ---- a round's training, step by step --------------------------------------------------------
    def validate(self, replies: Iterable[Message], kept: PhasePlan) -> list[ClientUpdate]:
        return self.inner.validate(replies, kept)

    def aggregate_updates(
        self, server_round: int, updates: list[ClientUpdate]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.inner.aggregate_updates(server_round, updates)

    def aggregate_sums(self, server_round: int, total: RoundSum, updates: list[ClientUpdate]) -> dict[str, float]:
        return self.inner.aggregate_sums(server_round, total, updates)

    def train_result(
        self, kept: PhasePlan, updates: list[ClientUpdate], metrics: dict[str, float]
    ) -> tuple[ArrayRecord, MetricRecord]:
        return self.inner.train_result(kept, updates, metrics)
