"""The distributed discrete Gaussian mechanism (Kairouz, Liu and Steinke, "The Distributed
Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021): each
client scales its vector by 1/gamma, rounds it to integers, and adds discrete Gaussian noise
N_Z(0, sigma_c^2) to every coordinate before secure aggregation; the server only ever sees the
sum, which carries the noise of every client in it.

What is proven, and how this module uses it:

- Privacy of the sum (their Theorem 1 and Proposition 14, as google-research/federated's
  ``distributed_dp/accounting_utils.py`` evaluates them): for n clients each adding
  N_Z(0, sigma_c^2) to integer vectors of dimension d whose L2 sensitivity is Delta, the sum
  satisfies (alpha, alpha * l^2 / 2 + tau * d)-RDP for every alpha > 1, where
  l = Delta / (sqrt(n) * sigma_c) and tau = 10 * sum_{k=1}^{n-1} exp(-2 pi^2 sigma_c^2 k/(k+1)).
  That is (xi, rho)-zCDP with rho = l^2 / 2 and xi = tau * d, which dp-accounting's RDP
  accountant composes exactly (``ZCDpEvent``). tau is accounted, not neglected: it is small
  only once sigma_c is well above 1 (``tau``: 5.2e-4 at sigma_c = 1 and n = 2, 5.4e-4 at n = 20,
  5.7e-4 at n = 1,000; 7.2e-17 at sigma_c = 2 and n = 2), and this module refuses sigma_c < 1,
  where the sampler's floating-point acceptance also loses accuracy.
- Sensitivity after rounding: rounding is ``floor(x / gamma + u)`` with u uniform on [0, 1)
  per coordinate (unbiased). Two neighbouring inputs rounded with the same u differ by at most
  ceil(|x_j - x'_j| / gamma) <= |x_j - x'_j| / gamma + 1 in every coordinate, so in L2 by at most
  Delta = s / gamma + sqrt(d) for an input sensitivity s. By the joint convexity of Renyi
  divergences, the mechanism with random u is at least as private as the worst fixed u, so
  Delta bounds it. The sqrt(d) term is what rounding costs; ``granularity`` picks gamma so that
  it is a chosen fraction of s / gamma.
- Who must take part: the sum carries n * sigma_c^2 of variance only if n clients' noise is in
  it. Clients draw sigma_c for ``n_min`` survivors, the smallest number the secure aggregation
  completes with (its threshold: every node refuses to help unmask a sum of fewer), so the
  accounting above, with n = n_min, holds whatever dropouts the protocol tolerates; more
  survivors only add noise. Colluding clients that skip their noise lower it: the guarantee
  assumes at least ``n_min`` honest survivors.
- Modular wrap-around: the sum is kept modulo 2^bits. Wrapping is a post-processing of the
  noisy sum, so it never weakens privacy, only utility: ``wrap_probability`` bounds the chance
  that any coordinate wraps (each client's coordinates are at most its norm bound / gamma + 1;
  the discrete Gaussian is sigma-subgaussian, Canonne, Kamath and Steinke 2020, Proposition 19).
  No random rotation is applied: the bound above holds without one, at the cost of bits.

The sampler is Canonne, Kamath and Steinke's (NeurIPS 2020, Algorithm 3: discrete Laplace
proposals, accepted with probability exp(-(|y| - sigma^2/t)^2 / (2 sigma^2))), vectorised in
floating point as tensorflow-privacy's ``discrete_gaussian_utils`` does; its randomness is the
node's noise source (``privacy.mechanisms``).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import numpy as np

from fedvlm.privacy.noise_check import check_noise

MIN_CLIENT_SIGMA = 1.0  # below it tau grows quickly and the sampler's float acceptance loses accuracy
# the shortest share the noise check judges: the discrete Gaussian's atoms (at sigma >= 1 a draw is
# 0 with probability below 0.4, so a vector is all zeros with probability below 0.4^d) stay far
# inside the check's chi-square interval from 64 coordinates on (0.4^64 = 3e-26; 20,000 honest
# shares of 64 coordinates at sigma 1 fell between 30 and 114, the interval being 12.8 to 180);
# every summed vector in this project is far longer (a prompt: 1,536 coordinates)
CHECKED_DIM = 64


class Uniforms:
    """Uniform draws on [0, 1): from the operating system (``os.urandom``, 53-bit) or from a
    seeded NumPy generator (a simulation's reproducible noise)."""

    def __init__(self, rng: np.random.Generator | None):
        self.rng = rng

    def __call__(self, size: int) -> np.ndarray:
        if self.rng is not None:
            return self.rng.random(size)
        raw = np.frombuffer(os.urandom(8 * size), dtype=np.uint64)
        return (raw >> np.uint64(11)).astype(np.float64) / 2.0**53


def discrete_gaussian(size: int, sigma: float, uniforms: Uniforms) -> np.ndarray:
    """``size`` independent draws of N_Z(0, sigma^2) (int64)."""
    if sigma <= 0:
        raise ValueError(f"a discrete Gaussian needs sigma > 0, got {sigma}")
    t = math.floor(sigma) + 1
    p = 1.0 - math.exp(-1.0 / t)  # discrete Laplace(t) = difference of two geometrics of this rate
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        want = max(16, 2 * (size - filled))
        g1 = np.floor(np.log1p(-uniforms(want)) / math.log1p(-p)).astype(np.int64)
        g2 = np.floor(np.log1p(-uniforms(want)) / math.log1p(-p)).astype(np.int64)
        y = g1 - g2
        accept = uniforms(want) < np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        taken = y[accept][: size - filled]
        out[filled : filled + taken.size] = taken
        filled += taken.size
    return out


def stochastic_round(x: np.ndarray, uniforms: Uniforms) -> np.ndarray:
    """floor(x + u), u uniform on [0, 1): unbiased, and within 1 of x in every coordinate."""
    return np.floor(np.asarray(x, dtype=np.float64) + uniforms(x.size).reshape(x.shape)).astype(np.int64)


def tau(client_sigma: float, n: int) -> float:
    """Kairouz et al.'s tau: how far a sum of n discrete Gaussians is from one discrete Gaussian."""
    return 10.0 * sum(math.exp(-2.0 * math.pi**2 * client_sigma**2 * k / (k + 1)) for k in range(1, n))


@dataclass(frozen=True)
class DistributedGaussian:
    """One round's distributed discrete Gaussian: what every client does to its vector, and what
    the sum of ``n_min`` or more such vectors guarantees."""

    gamma: float  # the quantisation step: a client sends round(x / gamma) + noise
    client_sigma: float  # sigma_c, in quantisation steps
    n_min: int  # the fewest clients whose noise the sum carries (the protocol's threshold)
    dim: int  # coordinates per vector
    norm_bound: float  # every client's vector has L2 norm at most this (before scaling)
    bits: int  # the sum is kept modulo 2^bits

    def __post_init__(self) -> None:
        if self.client_sigma < MIN_CLIENT_SIGMA:
            raise ValueError(
                f"each client's discrete Gaussian has sigma {self.client_sigma:.3g} quantisation steps, below "
                f"{MIN_CLIENT_SIGMA}: use a finer quantisation (smaller gamma) for this noise level"
            )
        if self.n_min < 1 or self.dim < 1 or self.gamma <= 0:
            raise ValueError("a distributed Gaussian needs n_min >= 1, dim >= 1 and gamma > 0")

    @classmethod
    def for_mean(
        cls, sigma_mean: float, gamma: float, denominator: int, n_min: int, dim: int, norm_bound: float, bits: int
    ) -> DistributedGaussian:
        """The clients' shares of a release planned as N(0, ``sigma_mean``^2) on a sum divided by
        ``denominator``: ``n_min`` shares carry sigma_mean * denominator between them."""
        return cls(gamma, sigma_mean * denominator / (gamma * math.sqrt(n_min)), n_min, dim, norm_bound, bits)

    @property
    def total_sigma(self) -> float:
        """The noise of a sum of ``n_min`` clients, in the input's units."""
        return self.gamma * self.client_sigma * math.sqrt(self.n_min)

    def sensitivity(self, input_sensitivity: float) -> float:
        """The L2 sensitivity of the rounded vector, for an input sensitivity s: s / gamma + sqrt(d)."""
        return input_sensitivity / self.gamma + math.sqrt(self.dim)

    def zcdp(self, input_sensitivity: float) -> tuple[float, float]:
        """(rho, xi): one release is (xi, rho)-zCDP, i.e. (alpha, xi + rho * alpha)-RDP."""
        scale = self.sensitivity(input_sensitivity) / (math.sqrt(self.n_min) * self.client_sigma)
        return scale**2 / 2.0, tau(self.client_sigma, self.n_min) * self.dim

    def wrap_probability(self, clients: int) -> float:
        """A bound on the chance that some coordinate of a sum of ``clients`` vectors leaves
        [-2^(bits-1), 2^(bits-1)) and wraps (1.0 when the signal alone may reach it)."""
        signal = clients * (self.norm_bound / self.gamma + 1.0)
        room = 2.0 ** (self.bits - 1) - 1 - signal
        if room <= 0:
            return 1.0
        k = room / (self.client_sigma * math.sqrt(clients))
        return min(1.0, 2.0 * self.dim * math.exp(-(k**2) / 2.0))

    def encode(self, x: np.ndarray, uniforms: Uniforms) -> np.ndarray:
        """A client's noisy integer vector: its ``x`` projected onto the ball of radius
        ``norm_bound``, scaled, rounded, plus N_Z(0, client_sigma^2) per coordinate. The
        projection is non-expansive, so a record still moves the result by at most its
        sensitivity: the accounting holds for whatever bound a plan states, and nothing is refused
        with a value of the data. The share passes the check every noise draw passes
        (``privacy.noise_check``) before it is added."""
        x = np.asarray(x, dtype=np.float64).ravel()
        if x.size != self.dim:
            raise ValueError(f"expected a vector of {self.dim} coordinates, got {x.size}")
        norm = float(np.linalg.norm(x))
        if norm > self.norm_bound:
            x = x * (self.norm_bound / norm)
        rounded = stochastic_round(x / self.gamma, uniforms)
        noise = discrete_gaussian(self.dim, self.client_sigma, uniforms)
        if self.dim >= CHECKED_DIM:
            check_noise({"its share of the sum's noise": noise}, self.client_sigma, "this node")
        return rounded + noise

    def decode(self, total: np.ndarray) -> np.ndarray:
        """The sum in the input's units, from the unmasked signed integer sum."""
        return np.asarray(total, dtype=np.float64) * self.gamma

    def as_dict(self) -> dict:
        return {**asdict(self), "total_sigma": self.total_sigma}


def granularity(input_sensitivity: float, dim: int, rounding_overhead: float) -> float:
    """The quantisation step gamma at which rounding adds ``rounding_overhead`` (a fraction) to
    the rounded sensitivity: sqrt(d) = overhead * s / gamma."""
    if not 0 < rounding_overhead:
        raise ValueError(f"the rounding overhead must be positive, got {rounding_overhead}")
    return rounding_overhead * input_sensitivity / math.sqrt(dim)
