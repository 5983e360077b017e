"""The audited node's side of the one-run privacy audit (``privacy.audit-canaries``).

The node whose partition id is ``privacy.audit-node`` carries the canaries
(``privacy.canaries``): drawn from OS entropy on its first round, kept in its private state
across rounds, scored by the training loop at every private step. After each round it reports
the audit's counts and bound as metrics (numbers only; which canaries are in and their scores
never leave the node), and the server writes them beside the accounted epsilon
(``privacy.audit.audit_section``).
"""

from __future__ import annotations

from flwr.app import RecordDict

from fedvlm.client_app.state import AUDIT, load_private, save_private
from fedvlm.metrics import AUDIT_FIGURES, AUDIT_METRICS
from fedvlm.privacy.canaries import Canaries
from fedvlm.runconfig import RunConfig

# the metric keys of an audited node's train reply, read back by privacy.audit.audit_section


def node_canaries(cfg: RunConfig, partition_id: int, state: RecordDict) -> Canaries | None:
    """This node's canaries if it is the audited one (drawn on first use), else None."""
    settings = cfg.privacy
    if not settings.audit_canaries or partition_id != settings.audit_node:
        return None
    saved = load_private(state, AUDIT)
    return Canaries.from_state_dict(saved) if saved else Canaries.draw(settings.audit_canaries)


def finish_round(cfg: RunConfig, canaries: Canaries, state: RecordDict) -> dict[str, float | int]:
    """Keep the canaries for the next round; the audit as it stands, as reply metrics."""
    save_private(state, canaries.state_dict(), AUDIT)
    result = canaries.audit(cfg.privacy.delta)
    values = (result.canaries, result.guesses, result.correct, result.guessed_in, result.epsilon_lower, canaries.steps)
    return {AUDIT_METRICS[k]: v for k, v in zip(AUDIT_FIGURES, values, strict=True)}
