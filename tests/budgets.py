"""A run's privacy budget as its strategy plans it, for tests that need one without a run."""

from __future__ import annotations

from fedvlm.privacy.budget import RunBudget
from fedvlm.privacy.ledger import PrivacyLedger
from fedvlm.privacy.planner import ClientShape
from fedvlm.spec import spec_of


def planned(cfg, shapes: dict[str, ClientShape], source: str = "seeded") -> RunBudget:
    """``cfg``'s mechanisms planned for ``shapes`` (every node drawing its noise from ``source``)."""
    spec = spec_of(cfg)
    return RunBudget.planned(
        cfg.privacy,
        PrivacyLedger(cfg.privacy, spec.name),
        cfg.num_server_rounds,
        spec.local_dp(cfg),
        spec.global_dp(cfg, len(shapes)),
        shapes,
        dict.fromkeys(shapes, source),
    )
