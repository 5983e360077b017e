"""Noise calibration and privacy accounting for Gaussian mechanisms.

Two calibrations, both recorded in every run's ledger:

- ``paper``: DP-FPL's Theorem 3.3 with constant 1, σ = S·sqrt(T·ln(1/δ))/ε, which is what the
  paper's code uses. It is a loose closed form, not an accountant; the ledger therefore also
  reports the ε that an accountant gives for the σ actually drawn (no subsampling
  amplification is claimed for the fixed-size minibatches this mode uses).
- ``accountant``: a real accountant from Google's dp-accounting (RDP or PLD) composes every
  Gaussian release of the run, calibrates the noise multiplier z = σ/S for a target (ε, δ),
  and reports the ε actually spent after every round.

Events: a release is a Gaussian mechanism with noise multiplier z, optionally Poisson
subsampled with rate q (DP-SGD style record sampling), repeated ``count`` times; or a mechanism
known only by its zCDP bound (``ZCDpReleases``: the distributed discrete Gaussian).
Neighbouring datasets differ by adding or removing one record (dp-accounting's default).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import dp_accounting
from absl import logging as absl_logging

from fedvlm.errors import PublicError
from fedvlm.privacy.accountants import REFERENCE, get_accountant

# dp-accounting logs a warning for every RDP order it drops at small noise; the result is
# still a valid bound, so keep the console for what users need.
absl_logging.set_verbosity(absl_logging.ERROR)

MEANINGLESS_EPSILON = 100.0  # an epsilon beyond this bounds nothing; tight accountants are skipped


class BudgetError(PublicError, ValueError):
    """A privacy budget that cannot be met; the message says which knob to change."""


# delta is the probability with which an (epsilon, delta)-DP mechanism may fail outright (e.g.
# publish a record): it must be well below 1/n for n records, or the guarantee allows
# publishing some of them. "Well below": delta * n at most this.
DELTA_TIMES_RECORDS = 0.1


def check_delta(delta: float, records: int, whose: str, fix: str) -> None:
    """``BudgetError`` unless ``delta`` is well below 1 / ``records`` (``whose`` records they are)."""
    if not (0 < delta and delta * records <= DELTA_TIMES_RECORDS):
        best = DELTA_TIMES_RECORDS / max(records, 1)
        raise BudgetError(
            f"delta = {delta:g} is not well below 1/records for {whose} {records} training records (an "
            f"(epsilon, delta) guarantee may then expose about delta x records = {delta * records:.3g} of them "
            f"outright): {fix} to at most {best:.2g}"
        )


def paper_sigma(sensitivity: float, releases: int, delta: float, epsilon: float) -> float:
    """DP-FPL's closed form σ = S·sqrt(T·ln(1/δ))/ε (Theorem 3.3, constant 1)."""
    if epsilon <= 0 or not 0 < delta < 1 or releases < 1:
        raise ValueError("need epsilon > 0, 0 < delta < 1 and at least one release")
    return sensitivity * math.sqrt(releases * math.log(1.0 / delta)) / epsilon


@dataclass(frozen=True)
class GaussianReleases:
    """``count`` Gaussian releases with noise multiplier z, each Poisson-subsampled at rate q
    (q = 1: every record takes part in every release)."""

    noise_multiplier: float
    count: int
    sampling_rate: float = 1.0

    @property
    def infinite(self) -> bool:
        return self.noise_multiplier <= 0

    def event(self) -> dp_accounting.DpEvent:
        one: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_rate < 1.0:
            one = dp_accounting.PoissonSampledDpEvent(self.sampling_rate, one)
        return dp_accounting.SelfComposedDpEvent(one, self.count)


@dataclass(frozen=True)
class ZCDpReleases:
    """``count`` releases, each (xi, rho)-zCDP: (alpha, xi + rho * alpha)-RDP at every order
    (the distributed discrete Gaussian's bound, ``privacy.distributed``). No subsampling
    amplification is claimed for them. Only accountants that compose Renyi bounds take them."""

    rho: float
    xi: float
    count: int

    @property
    def infinite(self) -> bool:
        return math.isinf(self.rho) or math.isinf(self.xi)

    def event(self) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(self.rho, self.xi), self.count)


Releases = GaussianReleases | ZCDpReleases


def joint_noise_multiplier(*multipliers: float) -> float:
    """The noise multiplier of one Gaussian release made of several parts computed from the same
    records (e.g. a local and a global gradient of one batch), each part with its own z: the
    record's scaled contributions add in quadrature, 1/z^2 = sum 1/z_i^2."""
    if any(z <= 0 for z in multipliers):
        return 0.0
    return float(sum(z**-2 for z in multipliers) ** -0.5)


def epsilon_spent(releases: Releases | Sequence[Releases], delta: float, accountant: str = REFERENCE) -> float:
    """ε after ``releases`` (one group, or several groups composed) at ``delta``; 0 with no
    release, infinite if any release has z = 0."""
    parts = [releases] if isinstance(releases, (GaussianReleases, ZCDpReleases)) else list(releases)
    parts = [p for p in parts if p.count > 0]
    if not parts:
        return 0.0
    if any(p.infinite for p in parts):
        return math.inf
    return _epsilon(tuple(parts), float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon(parts: tuple[Releases, ...], delta: float, accountant: str) -> float:
    # Cached: every round asks again for the same few (z, q, count) combinations, and a PLD
    # evaluation costs a large fraction of a second.
    chosen = get_accountant(accountant)
    if chosen.grows_with_epsilon:
        # past MEANINGLESS_EPSILON the reference bound (valid, looser) is returned instead
        bound = _epsilon(parts, delta, REFERENCE)
        if bound > MEANINGLESS_EPSILON:
            return bound
    acc = chosen.make()
    event = dp_accounting.ComposedDpEvent([p.event() for p in parts]) if len(parts) > 1 else parts[0].event()
    if not acc.supports(event):
        raise BudgetError(
            f"privacy.accountant = {accountant!r} cannot compose these releases (a zCDP bound, such as the "
            f"distributed discrete Gaussian's, needs a Renyi accountant): set privacy.accountant = {REFERENCE!r}"
        )
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def smallest_scale(epsilon_at: Callable[[float], float], target: float, tol: float = 1e-4) -> float:
    """The smallest factor c >= 1 with ``epsilon_at(c) <= target``, for an ``epsilon_at`` that
    falls as c (a common factor on every noise multiplier) grows. Used to calibrate several
    mechanisms jointly: scale all their noise together until the composition meets the target."""
    if epsilon_at(1.0) <= target:
        return 1.0
    lo, hi = 1.0, 2.0
    while epsilon_at(hi) > target:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise BudgetError(f"no noise level brings the composed epsilon down to {target}")
    while hi / lo > 1 + tol:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if epsilon_at(mid) > target else (lo, mid)
    return hi


def calibrate_noise_multiplier(
    target_epsilon: float, delta: float, count: int, sampling_rate: float = 1.0, accountant: str = REFERENCE
) -> float:
    """The smallest z whose ``count`` releases (subsampled at q) spend at most ``target_epsilon``."""
    if target_epsilon <= 0:
        raise ValueError("target epsilon must be positive")
    if count < 1:
        raise ValueError("nothing to calibrate: no releases planned")

    def make_event(z: float) -> dp_accounting.DpEvent:
        return GaussianReleases(z, count, sampling_rate).event()

    try:
        # The reference (RDP) first: cheap at any z. Another accountant then searches near its
        # answer: PLD is tighter (needs less noise), and very small z makes its distributions
        # huge, so it must not search from scratch.
        reference = get_accountant(REFERENCE).make
        bracket = dp_accounting.LowerEndpointAndGuess(0.05, 1.0)
        z = dp_accounting.calibrate_dp_mechanism(
            reference, make_event, target_epsilon, delta, bracket_interval=bracket, tol=1e-4
        )
        if accountant != REFERENCE:
            z = _near(get_accountant(accountant).make, make_event, target_epsilon, delta, z)
    except dp_accounting.mechanism_calibration.NoBracketIntervalFoundError as err:
        raise BudgetError(
            f"no noise level reaches epsilon={target_epsilon} at delta={delta} over {count} releases: "
            "raise privacy.epsilon or privacy.delta, or plan fewer rounds/steps"
        ) from err
    # calibrate_dp_mechanism returns a value within tol of the optimum from the safe side for
    # monotone mechanisms; step up until the accountant confirms the target is met.
    while epsilon_spent(GaussianReleases(z, count, sampling_rate), delta, accountant) > target_epsilon * (1 + 1e-9):
        z *= 1.0001
    return float(z)


def _near(
    make: Callable[[], dp_accounting.PrivacyAccountant],
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    reference_z: float,
) -> float:
    """The smallest z an accountant accepts, searched from the reference's answer ``reference_z``:
    below it for a tighter accountant (PLD), above it for a looser one."""
    try:
        bracket = dp_accounting.ExplicitBracketInterval(0.5 * reference_z, 1.02 * reference_z)
        return dp_accounting.calibrate_dp_mechanism(
            make, make_event, target_epsilon, delta, bracket_interval=bracket, tol=1e-4
        )
    except ValueError:  # brentq's: the interval holds no answer, the accountant is looser
        bracket = dp_accounting.LowerEndpointAndGuess(reference_z, 2.0 * reference_z)
        return dp_accounting.calibrate_dp_mechanism(
            make, make_event, target_epsilon, delta, bracket_interval=bracket, tol=1e-4
        )
