"""The accountants a run may calibrate its noise and report its epsilon with: one registry.

``privacy.accountant`` accepts exactly the names registered here (``runconfig.schema`` reads this
dict, so a registration made before a run's config is checked is accepted), the budget reports
every registered accountant's figure beside the nodes' own (``privacy.budget.RunBudget.by_accountant``),
and docs/configuration.md lists them (``python -m fedvlm.runconfig --markdown``). Like Opacus'
``accountants/registry.py``, a new accountant is one ``register_accountant`` call.

This module imports neither torch nor dp-accounting (2 s to import): the config schema reads the
names on every node; ``make`` imports dp-accounting only when an accountant is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Accountant:
    """One accountant: ``make`` builds a fresh dp-accounting ``PrivacyAccountant``."""

    name: str
    summary: str
    make: Callable[[], Any]
    # Its cost grows with epsilon (PLD discretises the privacy-loss distribution on a grid that
    # grows with it): at vanishing noise it would exhaust memory for a figure that only says "no
    # privacy", so past accounting.MEANINGLESS_EPSILON the RDP bound (valid, looser) stands in.
    grows_with_epsilon: bool = False


ACCOUNTANTS: dict[str, Accountant] = {}
# the accountant that bounds every other one's search: cheap and valid at any noise level
REFERENCE = "rdp"


def register_accountant(accountant: Accountant) -> Accountant:
    """Add ``accountant`` to the registry; a name registered twice is refused."""
    if accountant.name in ACCOUNTANTS:
        raise ValueError(f"an accountant named {accountant.name!r} is already registered")
    ACCOUNTANTS[accountant.name] = accountant
    return accountant


def get_accountant(name: str) -> Accountant:
    try:
        return ACCOUNTANTS[name]
    except KeyError:
        raise ValueError(
            f"privacy.accountant = {name!r} is not a registered accountant; accepted: {', '.join(ACCOUNTANTS)}"
        ) from None


def _rdp() -> Any:
    from dp_accounting import rdp

    return rdp.RdpAccountant()


def _pld() -> Any:
    from dp_accounting import pld

    return pld.PLDAccountant(value_discretization_interval=1e-3)


register_accountant(
    Accountant(REFERENCE, "dp-accounting's RdpAccountant: Renyi DP, a valid upper bound, cheap at any noise", _rdp)
)
register_accountant(
    Accountant(
        "pld",
        "dp-accounting's PLDAccountant: privacy loss distributions, tighter, so less noise for the same epsilon",
        _pld,
        grows_with_epsilon=True,
    )
)
