"""Secure aggregation on the server, as one layer around the method's strategy, the way Flower's
SecAgg+ workflow and DP wrappers wrap theirs: the method's strategy builds its train messages,
validates replies and folds in a sum, and never knows whether it runs under this layer.

What the layer does to the round (``loop.HOOKS``, the same hooks the strategy has):
- ``configure_train``: the strategy's messages, each with the round's one plan added
  (``strategies.secure_sum.SecureSum.plan``); the round's replies will carry figures only
  (``PhasePlan.tensors_in_replies``). A round that cannot be summed securely trains no one: a
  train message without its plan would have its update sent in clear (and every node that
  requires secure aggregation refuses one).
- ``next_stage``: the protocol's later stages, the train replies validated by the strategy's own
  checks (``FederatedStrategy.validate``) before any node enters the protocol;
- ``aggregate_train``: the strategy folds in the survivors' unmasked sum
  (``FederatedStrategy.aggregate_sums``) in place of their updates; a node whose update is not
  in the sum is recorded as dropped with the reason.
- the run's global noise is drawn by the clients in shares (``RunParts.shares``: the distributed
  discrete Gaussian, ``privacy.distributed``), planned for as many survivors as the protocol's
  threshold guarantees.
Every other hook is the strategy's (``strategies.layer``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedvlm.privacy.planner import Distributed
from fedvlm.protocol import SECAGG_MASKED
from fedvlm.secagg.server import SecAggError
from fedvlm.strategies.base import FederatedStrategy
from fedvlm.strategies.layer import Layer
from fedvlm.strategies.secure_sum import SecureSum, threshold

log = logging.getLogger(__name__)


class SecureAggregation(Layer):
    """``strategy`` under secure aggregation (the module docstring)."""

    def __init__(self, strategy: FederatedStrategy | Layer):
        super().__init__(strategy)
        parts = strategy.parts
        settings = parts.cfg.secure_aggregation
        self.sums = SecureSum(settings, parts.cfg.seed, strategy.sum_weighted)

        def shares(dim: int, per_round: int) -> Distributed:
            return Distributed(dim, threshold(settings, per_round), settings.rounding_overhead, settings.bits)

        parts.shares = shares

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        if not messages:
            return []
        parts = self.parts
        kept = parts.phase(server_round, "train")
        noise = parts.budget.distributed_noise()
        bound = parts.cfg.privacy.clip if noise is not None else parts.cfg.replies.max_norm
        try:
            self.sums.plan(server_round, kept, messages, noise, bound)
        except SecAggError as why:
            log.error("round %d is skipped: %s", server_round, why)
            kept.secure, kept.outgoing = {"failed": str(why)}, {}
            return []
        kept.tensors_in_replies = False
        if kept.protocol.prekeyed:  # the masked vector comes with the train reply: the protocol checks it
            kept.layer_tensors = frozenset({SECAGG_MASKED})
        return messages

    def next_stage(self, server_round: int, replies: Iterable[Message]) -> Iterable[Message]:
        kept = self.parts.phase(server_round, "train")
        return self.sums.advance(server_round, list(replies), kept, self.validate)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The survivors' sum folded in; ``replies`` were validated as the protocol began."""
        kept = self.parts.phase(server_round, "train")
        updates, left_out = self.sums.in_sum(server_round)
        for name, why in left_out.items():
            kept.drop(name, why)
        total = self.sums.total(server_round)
        metrics = self.aggregate_sums(server_round, total, updates) if total is not None else {}
        self.sums.finish(server_round)
        return self.train_result(kept, updates, metrics)
