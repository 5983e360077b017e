"""The distributed discrete Gaussian (``privacy.distributed``): the sampler draws N_Z(0, sigma^2),
rounding costs at most sqrt(d) of sensitivity for neighbouring inputs, the exact Renyi divergence
of the released sum never exceeds the bound the ledger uses, the wrap-around bound holds, and the
accountant's epsilon equals an independent evaluation of the same analysis."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import logsumexp

from fedvlm.privacy.accounting import BudgetError, GaussianReleases, ZCDpReleases, epsilon_spent
from fedvlm.privacy.distributed import (
    DistributedGaussian,
    Uniforms,
    discrete_gaussian,
    granularity,
    stochastic_round,
    tau,
)


def _pmf(sigma: float, support: np.ndarray) -> np.ndarray:
    w = np.exp(-(support.astype(float) ** 2) / (2 * sigma**2))
    return w / w.sum()


@pytest.mark.parametrize("sigma", [1.0, 3.5])
def test_the_sampler_draws_the_discrete_gaussian(sigma):
    draws = discrete_gaussian(200_000, sigma, Uniforms(np.random.default_rng(0)))
    support = np.arange(-12 * int(sigma + 1), 12 * int(sigma + 1) + 1)
    expected = _pmf(sigma, support)
    counts = np.array([(draws == y).sum() for y in support])
    seen = expected > 1e-4
    chi2 = float((((counts - 200_000 * expected) ** 2) / (200_000 * expected))[seen].sum())
    assert chi2 < 3 * seen.sum()  # chi-square with about seen.sum() degrees of freedom
    assert abs(draws.mean()) < 0.02 * sigma


def test_os_randomness_draws_too():
    draws = discrete_gaussian(50_000, 2.0, Uniforms(None))
    assert abs(draws.var() / 4.0 - 1) < 0.05


def test_neighbouring_inputs_round_to_vectors_within_the_stated_sensitivity():
    rng = np.random.default_rng(1)
    d, s = 64, 3.0
    worst = 0.0
    for _ in range(300):
        x = rng.normal(size=d) * 10
        step = rng.normal(size=d)
        x2 = x + s * step / np.linalg.norm(step)
        u = Uniforms(np.random.default_rng(int(rng.integers(1 << 30))))
        shared = u(d)  # the same uniforms for both: the coupling the bound is proven with
        r1 = np.floor(x + shared).astype(np.int64)
        r2 = np.floor(x2 + shared).astype(np.int64)
        worst = max(worst, float(np.linalg.norm(r1 - r2)))
    assert worst <= s + math.sqrt(d)
    assert worst > s  # rounding does add to it: the sqrt(d) term is not for show


@pytest.mark.parametrize("alpha", [2, 8, 32])
@pytest.mark.parametrize("x,x2", [(0.3, 1.1), (5.0, 5.9), (0.0, 2.5), (0.9, 1.05)])
def test_the_exact_renyi_divergence_of_neighbouring_sums_is_within_the_bound(alpha, x, x2):
    """One coordinate, two clients (one fixed, one holding x or x'), computed exactly: the
    released sum's distribution under each input, and their Renyi divergence, against the
    (alpha, alpha l^2/2 + tau d) bound with the rounded sensitivity |x - x'| + 1."""
    sigma_c, other = 1.2, 3.7
    mech = DistributedGaussian(gamma=1.0, client_sigma=sigma_c, n_min=2, dim=1, norm_bound=10.0, bits=32)
    grid = np.arange(-60, 61)
    noise = np.convolve(_pmf(sigma_c, grid), _pmf(sigma_c, grid))  # two clients' noise, on -120..120

    def released(v):
        out = np.zeros(noise.size + 40)
        for a, pa in ((math.floor(v), 1 - (v - math.floor(v))), (math.floor(v) + 1, v - math.floor(v))):
            for b, pb in (
                (math.floor(other), 1 - (other - math.floor(other))),
                (math.floor(other) + 1, other - math.floor(other)),
            ):
                shift = a + b + 20
                out[shift : shift + noise.size] += pa * pb * noise
        return out

    p, q = released(x), released(x2)
    keep = (p > 1e-300) & (q > 1e-300)  # the rest is below float precision on both sides
    divergence = float(logsumexp(alpha * np.log(p[keep]) + (1 - alpha) * np.log(q[keep]))) / (alpha - 1)
    rho, xi = mech.zcdp(abs(x - x2))
    assert divergence <= xi + rho * alpha + 1e-9
    if (x, x2, alpha) == (0.9, 1.05, 32):  # and the rounding term is needed: without it the bound fails
        assert divergence > alpha * (abs(x - x2) / (math.sqrt(2) * sigma_c)) ** 2 / 2


def test_the_wrap_bound_holds_where_wrapping_is_likely():
    mech = DistributedGaussian(gamma=1.0, client_sigma=40.0, n_min=4, dim=1, norm_bound=10.0, bits=9)
    bound = mech.wrap_probability(4)
    assert 0.01 < bound < 1.0
    rng = np.random.default_rng(2)
    u = Uniforms(rng)
    wrapped = 0
    for _ in range(4000):
        total = sum(mech.encode(np.full(1, 10.0), u) for _ in range(4))
        wrapped += bool(np.any(np.abs(total) >= 2 ** (mech.bits - 1)))
    assert 0 < wrapped / 4000 <= bound


def test_encode_projects_a_vector_past_its_bound_and_refuses_a_sigma_below_one():
    """A node never refuses with its update's norm (a value of its data): past the bound, the
    update is projected onto it, which is what it encodes (the same draws give the same ints)."""
    mech = DistributedGaussian(gamma=0.01, client_sigma=2.0, n_min=3, dim=4, norm_bound=1.0, bits=32)
    big = np.full(4, 1.0)  # norm 2
    projected = mech.encode(big, Uniforms(np.random.default_rng(0)))
    np.testing.assert_array_equal(projected, mech.encode(big / 2.0, Uniforms(np.random.default_rng(0))))
    with pytest.raises(ValueError, match="finer quantisation"):
        DistributedGaussian(gamma=1.0, client_sigma=0.5, n_min=3, dim=4, norm_bound=1.0, bits=32)


def test_a_share_that_is_not_the_planned_noise_is_refused(monkeypatch):
    """The share passes the check every noise draw passes: a sampler returning zeros, or noise
    of another scale, is refused before anything is encoded."""
    from fedvlm.privacy import distributed
    from fedvlm.privacy.noise_check import MechanismError

    mech = DistributedGaussian(gamma=0.01, client_sigma=4.0, n_min=3, dim=2048, norm_bound=1.0, bits=40)
    mech.encode(np.zeros(2048), Uniforms(np.random.default_rng(0)))  # an honest share passes
    monkeypatch.setattr(distributed, "discrete_gaussian", lambda size, sigma, u: np.zeros(size, dtype=np.int64))
    with pytest.raises(MechanismError, match="adds no noise at all"):
        mech.encode(np.zeros(2048), Uniforms(np.random.default_rng(0)))
    monkeypatch.setattr(
        distributed,
        "discrete_gaussian",
        lambda size, sigma, u: np.rint(np.random.default_rng(1).normal(0, sigma / 3, size)),
    )
    with pytest.raises(MechanismError, match="not the planned"):
        mech.encode(np.zeros(2048), Uniforms(np.random.default_rng(0)))


def test_rounding_is_unbiased_and_the_granularity_sets_its_overhead():
    x = np.full(100_000, 0.3)
    assert abs(stochastic_round(x, Uniforms(np.random.default_rng(0))).mean() - 0.3) < 0.01
    gamma = granularity(2.0, 400, 0.05)
    mech = DistributedGaussian(gamma=gamma, client_sigma=5.0, n_min=3, dim=400, norm_bound=2.0, bits=40)
    assert mech.sensitivity(2.0) == pytest.approx(1.05 * 2.0 / gamma)


def test_the_accountant_equals_an_independent_evaluation_of_the_same_bound():
    """dp-accounting's RDP accountant against Mironov's RDP of the Gaussian plus the zCDP bound,
    converted with Canonne-Kamath-Steinke's improved formula at the same orders, written here."""
    from dp_accounting.rdp import RdpAccountant

    mech = DistributedGaussian(gamma=0.002, client_sigma=3.0, n_min=5, dim=2048, norm_bound=1.0, bits=40)
    rho, xi = mech.zcdp(0.05)
    rounds, z_local, steps, delta = 30, 1.3, 4, 1e-5
    got = epsilon_spent([GaussianReleases(z_local, rounds * steps), ZCDpReleases(rho, xi, rounds)], delta, "rdp")
    orders = np.asarray(RdpAccountant()._orders, dtype=float)
    rdp = rounds * steps * orders / (2 * z_local**2) + rounds * (xi + rho * orders)
    ok = orders > 1.01
    eps = rdp[ok] + np.log1p(-1 / orders[ok]) - np.log(delta * orders[ok]) / (orders[ok] - 1)
    assert got == pytest.approx(float(eps.min()), rel=1e-9)
    assert tau(3.0, 5) < 1e-30  # at sigma_c = 3 the distributed sum is a discrete Gaussian to any precision


def test_an_accountant_that_cannot_compose_a_zcdp_bound_says_which_one_can():
    with pytest.raises(BudgetError, match="privacy.accountant = 'rdp'"):
        epsilon_spent([ZCDpReleases(0.01, 0.0, 3)], 1e-5, "pld")
