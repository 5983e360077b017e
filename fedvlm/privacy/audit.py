"""The one-run privacy audit's bound (Steinke, Nasr and Jagielski, "Privacy auditing with one (1)
training run", NeurIPS 2023): from an auditor's guesses about m canaries, each inserted into the
training data independently with probability 1/2, a lower bound on the epsilon of the mechanism
that trained on them.

The auditor guesses "in" or "out" for r of the canaries (abstaining on the rest) and v of its
guesses are right. An (epsilon, delta)-DP mechanism cannot let a guesser do much better than
randomised response with accuracy q = e^eps / (1 + e^eps):

    P[v or more right] <= f(v) + 2 m delta max_{1<=i<=v} (f(v - i) - f(v)) / i,
    f(u) = P[Binomial(r, q) >= u]

(with delta = 0 this is the plain Binomial tail). The audit's epsilon is the largest epsilon
whose bound on the observed v is below 1 - confidence: every smaller epsilon is rejected at
that confidence. It is a LOWER bound on the true epsilon: it can only fall short of the
accountant's number (weak canaries, few guesses), and a value above it means the mechanism or
its accounting is broken. The derivation and its sources: docs/research/privacy-audit-maths.md.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom


class AuditInputError(ValueError):
    """Counts that no audit can produce; the message names the one that is wrong."""


def _check(m: int, r: int, v: int, delta: float) -> None:
    if not (0 <= v <= r <= m):
        raise AuditInputError(
            f"audit counts must satisfy 0 <= correct <= guesses <= canaries, got correct={v}, guesses={r}, canaries={m}"
        )
    if not 0 <= delta < 1:
        raise AuditInputError(f"audit delta must be in [0, 1), got {delta}")


def guess_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on the probability that r guesses about m canaries get v or more right when
    the mechanism is (epsilon, delta)-DP (the p-value of observing v under that hypothesis)."""
    _check(m, r, v, delta)
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]; sf, not 1 - cdf, for q near 1
    if delta == 0 or v == 0:
        return tail
    i = np.arange(1, v + 1)
    # f(v - i) - f(v) = P[v - i <= Binomial < v]: the mass that delta may move above the threshold
    alpha = float(np.max((binom.sf(v - i - 1, r, q) - tail) / i))
    return min(tail + 2 * m * delta * max(alpha, 0.0), 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon that r guesses with v right (out of m canaries) reject at
    ``confidence``: the mechanism is not (eps, delta)-DP for any smaller eps. 0 when the guesses
    are no better than chance allows."""
    _check(m, r, v, delta)
    if not 0 < confidence < 1:
        raise AuditInputError(f"audit confidence must be in (0, 1), got {confidence}")
    significance = 1 - confidence
    if guess_p_value(m, r, v, 0.0, delta) >= significance:
        return 0.0
    lo, hi = 0.0, 1.0  # p-value(lo) < significance <= p-value(hi); the p-value grows with epsilon
    while guess_p_value(m, r, v, hi, delta) < significance:
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # every guess right with r huge and delta 0: no finite epsilon explains it
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        if guess_p_value(m, r, v, mid, delta) < significance:
            lo = mid
        else:
            hi = mid
    return lo
