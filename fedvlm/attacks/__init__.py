"""Privacy attacks that measure what a run's noise buys (membership inference)."""
