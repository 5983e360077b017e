"""Server strategy of Reprogrammable-FL (and its baselines): DP-FedAvg.

The server builds the method's model once on the CPU for the seeded initial values of the
trainable parameters (and the source model's fingerprint every client must match), sends them
to the sampled clients, and averages what comes back weighted by the clients' data sizes
(Algorithm 2). Each client runs DP-SGD; the server plans every client's mechanism (its Poisson
sampling rate from its data size, its L steps a round, the noise multiplier from
``privacy.noise-multiplier`` or calibrated to ``privacy.epsilon``) and reports after every
round the ε each client has spent by dp-accounting's RDP and PLD accountants, next to the
figures the clients' own Opacus accountants (RDP and PRV) report. Record-level DP: a record's
influence is bounded within its client's updates, the server adds no noise of its own.
"""

from __future__ import annotations

import numpy as np

from fedvlm.metrics import NODE_EPSILON_PRV, NODE_EPSILON_RDP
from fedvlm.models.reprogram import initial_model, source_model, trainable_state
from fedvlm.strategies.aggregation import weighted_average
from fedvlm.strategies.base import FederatedStrategy
from fedvlm.strategies.nodes import NodeInfo
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import Payload
from fedvlm.strategies.records import ClientUpdate, RoundSum


class ReprogramStrategy(FederatedStrategy):
    def __init__(self, parts: RunParts):
        super().__init__(parts)
        cfg = parts.cfg
        self.source = source_model(cfg)
        self.registry.server_fingerprint = self.source.fingerprint
        self._initial: dict[str, np.ndarray] | None = None

    def initial_arrays(self) -> dict[str, np.ndarray]:
        if self._initial is None:
            model = initial_model(self.cfg, self.spec.model_kind, self.num_classes())
            self._initial = {k: v.numpy().copy() for k, v in trainable_state(model).items()}
        return {k: v.copy() for k, v in self._initial.items()}

    def train_payload(self, node: NodeInfo, server_round: int, arrays: dict[str, np.ndarray]) -> Payload:
        return Payload(dict(arrays), {k: v.shape for k, v in arrays.items()})

    def _note_accounts(self, updates: list[ClientUpdate]) -> None:
        for u in updates:
            if NODE_EPSILON_RDP in u.reply.metrics:
                self.budget.note_node_account(
                    u.node.name, {"rdp": u.reply.metrics[NODE_EPSILON_RDP], "prv": u.reply.metrics[NODE_EPSILON_PRV]}
                )

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, float]:
        self._note_accounts(updates)
        self.global_arrays.update(
            weighted_average([u.reply.arrays for u in updates], [u.reply.num_examples for u in updates])
        )
        return {}

    def aggregate_sums(self, server_round: int, total: RoundSum, updates: list[ClientUpdate]) -> dict[str, float]:
        self._note_accounts(updates)  # the nodes' own accounts travel as figures, beside the masked sum
        return super().aggregate_sums(server_round, total, updates)
