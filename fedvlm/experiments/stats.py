"""The statistics of every table the experiments publish: a figure over seeds as its mean, its
sample standard deviation (ddof 1) and a 95% Student-t interval on the mean, and a difference
between two rows paired by seed where both ran the same seeds (Welch's interval otherwise).

Seeds are the unit of replication: each seed draws the partition, the initialisation and the
noise afresh, so the spread over seeds is the spread a reader re-running the board would see.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t

LEVEL = 0.95


@dataclass(frozen=True)
class Spread:
    """A figure over n seeds: the mean, the sample std (None below two seeds, and for an
    unpaired difference) and the 95% interval on the mean (None below two seeds)."""

    mean: float
    std: float | None
    n: int
    low: float | None
    high: float | None

    def excludes(self, value: float) -> bool:
        """Whether the whole interval lies on one side of ``value``."""
        return self.low is not None and self.high is not None and (self.low > value or self.high < value)

    def text(self, scale: float = 1.0, digits: int = 2) -> str:
        """'mean ± std' (the mean alone for one seed)."""
        mean = f"{self.mean * scale:.{digits}f}"
        return mean if self.std is None else f"{mean} ± {self.std * scale:.{digits}f}"

    def interval(self, scale: float = 1.0, digits: int = 2) -> str:
        """'mean [low, high]' (the mean alone for one seed)."""
        mean = f"{self.mean * scale:+.{digits}f}"
        if self.low is None or self.high is None:
            return mean
        return f"{mean} [{self.low * scale:+.{digits}f}, {self.high * scale:+.{digits}f}]"

    def as_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std, "n": self.n, "ci95": [self.low, self.high]}


def finite(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and np.isfinite(float(v))]


def finite_keys(values: Mapping[int, float | None]) -> set[int]:
    """The seeds with a finite figure: those a difference counts (and pairs, where both rows have them)."""
    return {s for s, v in values.items() if finite([v])}


def paired(a: Mapping[int, float | None], b: Mapping[int, float | None]) -> bool:
    """Whether ``difference`` pairs a and b by seed: both have a finite figure at the same seeds."""
    return finite_keys(a) == finite_keys(b)


def spread(values: Iterable[float | None]) -> Spread | None:
    """Mean, ddof-1 std and t interval of the finite values (None when there are none)."""
    vals = np.asarray(finite(values))
    if not len(vals):
        return None
    mean = float(vals.mean())
    if len(vals) < 2:
        return Spread(mean, None, 1, None, None)
    std = float(vals.std(ddof=1))
    half = float(student_t.ppf(0.5 + LEVEL / 2, len(vals) - 1)) * std / np.sqrt(len(vals))
    return Spread(mean, std, len(vals), mean - half, mean + half)


def difference(a: Mapping[int, float | None], b: Mapping[int, float | None]) -> Spread | None:
    """a - b over seeds. Paired (the per-seed differences' t interval) when both ran the same
    seeds; else Welch's interval with the Welch-Satterthwaite degrees of freedom."""
    a, b = {s: a[s] for s in finite_keys(a)}, {s: b[s] for s in finite_keys(b)}
    if not a or not b:
        return None
    if paired(a, b):
        return spread(float(a[s]) - float(b[s]) for s in a)  # type: ignore[arg-type]
    xa, xb = np.asarray(list(a.values()), float), np.asarray(list(b.values()), float)
    mean = float(xa.mean() - xb.mean())
    if len(xa) < 2 or len(xb) < 2:
        return Spread(mean, None, min(len(xa), len(xb)), None, None)
    va, vb = xa.var(ddof=1) / len(xa), xb.var(ddof=1) / len(xb)
    se = float(np.sqrt(va + vb))
    if se == 0.0:
        return Spread(mean, None, min(len(xa), len(xb)), mean, mean)
    dof = (va + vb) ** 2 / (va**2 / (len(xa) - 1) + vb**2 / (len(xb) - 1))
    half = float(student_t.ppf(0.5 + LEVEL / 2, dof)) * se
    return Spread(mean, None, min(len(xa), len(xb)), mean - half, mean + half)
