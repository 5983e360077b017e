"""The check every noise draw passes before what it noises may leave (a node's private step,
the server's release, a node's share of the distributed noise): the noise added has the planned
std, tensor by tensor, or nothing is released (``MechanismError``: the mechanism fails closed).
Torch tensors and NumPy arrays alike, so that a node's secure-aggregation stages check their
integer share without importing torch."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedvlm.errors import PublicError


class MechanismError(PublicError, RuntimeError):
    """A private step did not do what its plan says; nothing of it may leave the node."""


NOISE_SIGNIFICANCE = 1e-12


def _size(a: Any) -> int:
    return int(a.numel()) if hasattr(a, "numel") else int(np.asarray(a).size)


def _squares(a: Any) -> float:
    if hasattr(a, "double"):
        return float((a.double() ** 2).sum())
    return float(np.square(np.asarray(a, dtype=np.float64)).sum())


@functools.lru_cache(maxsize=1024)
def _chi2_interval(dof: int, tests: int = 1) -> tuple[float, float]:
    """The two-sided acceptance interval of a chi-square with ``dof`` degrees, at
    ``NOISE_SIGNIFICANCE`` shared by ``tests`` tests (Bonferroni)."""
    from scipy.stats import chi2  # scipy only where a step is private

    alpha = NOISE_SIGNIFICANCE / tests
    return float(chi2.ppf(alpha / 2, dof)), float(chi2.isf(alpha / 2, dof))


def check_noise(added: Mapping[str, Any], sigma: float, what: str = "this step") -> None:
    """The noise ``added`` to each noised tensor (noised minus clean) has std ``sigma``, tensor by
    tensor: a tensor's sum of squares over sigma^2 is chi-square with one degree per coordinate,
    tested two-sided at ``NOISE_SIGNIFICANCE`` over the number of tensors (Bonferroni: an honest
    release is refused with probability at most ``NOISE_SIGNIFICANCE`` however many tensors it
    has), and a tensor whose added noise is identically zero is refused outright (a continuous
    draw is never all zeros). Tested one by one, a tensor released without its noise is not lost
    among the others' coordinates. What each size catches: ``detectable_scale``; per method, in
    docs/privacy.md from ``bench/noise_check_power.py``: a 1,536-coordinate prompt is refused at
    noise x0.84 or x1.18 in one step (ViT-B/16's 8,192: x0.93 / x1.08), a 16,384-coordinate gate
    weight at x0.95 / x1.06, a 10-coordinate bias only near zero noise (x0.03) or x5.7."""
    tests = sum(1 for a in added.values() if _size(a))
    for name, a in added.items():
        dof = _size(a)
        if dof == 0:
            continue
        squares = _squares(a)
        if squares == 0.0:
            raise MechanismError(
                f"{what} adds no noise at all to {name} ({dof} coordinates), planned std {sigma:.4g}: refusing to "
                "release this round"
            )
        lo, hi = _chi2_interval(dof, tests)
        if not lo <= squares / sigma**2 <= hi:
            raise MechanismError(
                f"the noise {what} adds to {name} has std {math.sqrt(squares / dof):.4g} over {dof} coordinates, not "
                f"the planned {sigma:.4g} (chi-square test at {NOISE_SIGNIFICANCE:g} over {tests} tensor(s)): refusing "
                "to release this round"
            )


def detectable_scale(dof: int, tests: int = 1, power: float = 0.99) -> tuple[float, float]:
    """(below, above): noise scaled by a factor at most ``below`` (or at least ``above``) on a
    tensor of ``dof`` coordinates is refused with probability at least ``power`` by
    ``check_noise`` (one of ``tests`` tensors)."""
    from scipy.stats import chi2

    lo, hi = _chi2_interval(dof, tests)
    # scaled noise s*N(0, sigma^2): squares/sigma^2 = s^2 chi2(dof); refused when it leaves [lo, hi]
    below = math.sqrt(lo / float(chi2.ppf(power, dof)))
    above = math.sqrt(hi / float(chi2.ppf(1 - power, dof)))
    return below, above
