"""Privacy attacks that measure what a run's noise buys (membership inference)."""


class NoAttackApplies(Exception):
    """No membership attack applies to a run (its message says why): a row without attacks, not
    a failed one."""
