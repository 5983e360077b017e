"""What a run is made of besides its method's hooks: one object the round loop owns.

``RunParts`` holds the run's config, its privacy ledger and budget, the node registry, the
shared arrays and the plans of the rounds in flight. The ServerApp makes it (``of``) and builds the
method's strategy on it; the loop (``server_app.loop``) reads and records from it and calls the
strategy only through its hooks, and the hooks read and update it. There is one copy of each:
the arrays the loop sends are the ones the strategy aggregates into. A round's messages are the
post's (``server_app.post``), to which this is the desk (``phase``, ``node_name``, ``charge_replay``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedvlm.privacy.budget import NoBudget, RunBudget
from fedvlm.privacy.ledger import PrivacyLedger
from fedvlm.privacy.planner import Distributed
from fedvlm.runconfig import RunConfig
from fedvlm.spec import spec_of
from fedvlm.strategies.nodes import NodeRegistry
from fedvlm.strategies.plan import PhasePlan, RoundPlan


@dataclass
class RunParts:
    cfg: RunConfig
    ledger: PrivacyLedger
    registry: NodeRegistry
    # with privacy on, a RunBudget once the nodes are known (FederatedStrategy.prepare)
    budget: RunBudget | NoBudget = field(default_factory=NoBudget)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # the shared arrays, set after the handshake
    # the rounds being run, by round: what was sent and what validation found (the loop builds
    # each round's record from its plan, then takes it: ``take_plan``)
    plans: dict[int, RoundPlan] = field(default_factory=dict)
    # who draws a method's global noise: the server (None), or, given the mechanism's coordinates
    # and the clients sampled per round, the clients in shares (a layer around the strategy sets
    # it: strategies.secure_aggregation)
    shares: Callable[[int, int], Distributed] | None = None

    @classmethod
    def of(cls, cfg: RunConfig) -> RunParts:
        ledger = PrivacyLedger(cfg.privacy, spec_of(cfg).name)
        return cls(cfg, ledger, NodeRegistry(cfg, ledger))

    def phase(self, server_round: int, phase: str) -> PhasePlan:
        """Round ``server_round``'s plan of ``phase``, as ``configure_*`` made it."""
        return self.plans[server_round].phase(phase)

    def node_name(self, node_id: int) -> str | None:
        node = self.registry.nodes.get(node_id)
        return node.name if node is not None else None

    def charge_replay(self, name: str, server_round: int) -> tuple[bool, float | None]:
        """``RunBudget.charge_replay`` of asking ``name`` again for round ``server_round``'s training,
        with the noise sources of the nodes known now (some may have joined since the round was sent)."""
        return self.budget.charge_replay(name, server_round, self.registry.noise_sources())

    def take_plan(self, server_round: int) -> RoundPlan:
        """Round ``server_round``'s plan, forgotten here (an empty one for a round nothing was
        planned for: a method that does not train)."""
        return self.plans.pop(server_round, RoundPlan(server_round))
