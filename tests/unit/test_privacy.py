"""The privacy module against independent figures: hand-computed closed forms, dp-accounting
called directly, and the statistics of the noise actually drawn."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch

from fedvlm.privacy.accounting import (
    BudgetError,
    GaussianReleases,
    calibrate_noise_multiplier,
    epsilon_spent,
    paper_sigma,
)
from fedvlm.privacy.ledger import plan_gaussian
from fedvlm.privacy.mechanisms import gaussian_noise
from fedvlm.runconfig.schema import PrivacyConfig
from fedvlm.utils.rng import generator_for


def test_paper_sigma_by_hand():
    # S = C/B = 10/32, T = 100, delta = 1e-5, eps = 0.1: 0.3125 * sqrt(100 * ln 1e5) / 0.1
    assert paper_sigma(10 / 32, 100, 1e-5, 0.1) == pytest.approx(0.3125 * math.sqrt(100 * 11.512925464970229) / 0.1)
    assert paper_sigma(10 / 32, 100, 1e-5, 0.1) == pytest.approx(106.0334, rel=1e-5)
    # S_G = C/(N B) with N = 10: ten times less noise
    assert paper_sigma(10 / 320, 100, 1e-5, 0.1) == pytest.approx(10.60334, rel=1e-5)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("z,q,steps", [(1.1, 0.01, 1000), (4.0, 0.125, 40), (300.0, 1.0, 100)])
def test_epsilon_equals_dp_accounting_called_directly(accountant, z, q, steps):
    event = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    acc = (
        dp_accounting.rdp.RdpAccountant()
        if accountant == "rdp"
        else dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    )
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    assert epsilon_spent(GaussianReleases(z, steps, q), 1e-5, accountant) == pytest.approx(
        acc.get_epsilon(1e-5), rel=1e-9
    )


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibration_meets_the_target_tightly(accountant):
    z = calibrate_noise_multiplier(1.0, 1e-5, 200, 0.05, accountant)
    eps = epsilon_spent(GaussianReleases(z, 200, 0.05), 1e-5, accountant)
    assert eps <= 1.0 and eps > 0.98
    # more noise is never needed than the calibrated amount, less would break the target
    assert epsilon_spent(GaussianReleases(z * 0.97, 200, 0.05), 1e-5, accountant) > 1.0


def test_impossible_budget_is_a_clear_error():
    with pytest.raises((BudgetError, ValueError)):
        calibrate_noise_multiplier(0.0, 1e-5, 10)


def test_noise_has_the_std_the_ledger_claims():
    sigma = 0.37
    draws = gaussian_noise((200_000,), sigma, generator_for([0, 1, 2]))
    # sample std of 2e5 normals is within 0.5% of sigma with overwhelming probability
    assert float(draws.std()) == pytest.approx(sigma, rel=0.005)
    assert abs(float(draws.mean())) < 0.005
    again = gaussian_noise((200_000,), sigma, generator_for([0, 1, 2]))
    assert torch.equal(draws, again)  # seeded
    assert not torch.equal(draws, gaussian_noise((200_000,), sigma, generator_for([0, 1, 3])))


def _settings(**kw):
    base = dict(
        epsilon=0.5,
        delta=1e-5,
        clip=10.0,
        calibration="accountant",
        clipping="per-sample",
        max_epsilon=0.0,
        accountant="rdp",
        noise_multiplier=0.0,
    )
    base.update(kw)
    return PrivacyConfig(**base)


def test_plan_accountant_mode_records_what_it_used():
    plan = plan_gaussian(
        _settings(),
        "ldp",
        "client",
        "client",
        sensitivity=10 / 32,
        releases=50,
        sampling_rate=32 / 256,
        per_batch_sensitivity=20.0,
    )
    assert plan.sigma == pytest.approx(plan.noise_multiplier * 10 / 32)
    assert plan.planned_epsilon <= 0.5 and plan.planned_epsilon > 0.49
    assert plan.sampling == "poisson" and plan.sampling_rate == 0.125


def test_plan_paper_mode_reports_the_valid_epsilon_for_its_sigma():
    """The closed form plugs in C/B; with fixed-size batches a record added to the data
    displaces another from its batch, so the valid sensitivity is 2C/B (the audit measured the
    ledger's 1.77 against a valid 2.41-3.84 at the paper's scale)."""
    plan = plan_gaussian(
        _settings(calibration="paper"),
        "ldp",
        "client",
        "client",
        sensitivity=10 / 32,
        releases=100,
        sampling_rate=0.125,
        per_batch_sensitivity=20.0,
    )
    assert plan.sigma == pytest.approx(paper_sigma(10 / 32, 100, 1e-5, 0.5))
    assert plan.sampling_rate == 1.0  # fixed-size batches: no amplification claimed
    assert plan.true_sensitivity == pytest.approx(2 * 10 / 32)
    direct = epsilon_spent(GaussianReleases(plan.sigma / (2 * 10 / 32), 100, 1.0), 1e-5)
    assert plan.planned_epsilon == pytest.approx(direct)
    assert plan.planned_epsilon > epsilon_spent(GaussianReleases(plan.sigma / (10 / 32), 100, 1.0), 1e-5)
    assert any("displaces" in n for n in plan.notes)


def test_per_batch_clipping_is_flagged_and_accounted_with_the_true_sensitivity():
    plan = plan_gaussian(
        _settings(clipping="per-batch"),
        "ldp",
        "client",
        "client",
        sensitivity=10 / 32,
        releases=50,
        sampling_rate=0.125,
        per_batch_sensitivity=20.0,
    )
    assert any("does NOT hold" in n for n in plan.notes)
    assert plan.true_sensitivity == 20.0
    assert plan.planned_epsilon > 10 * plan.target_epsilon  # the stated 0.5 is far from true


def test_noise_is_roughly_gaussian_not_just_right_std():
    d = gaussian_noise((100_000,), 1.0, generator_for([5])).numpy()
    # fraction within one sigma of a normal is 0.6827
    assert np.mean(np.abs(d) < 1.0) == pytest.approx(0.6827, abs=0.005)


def test_noise_source_of_a_node():
    from functools import partial

    from fedvlm.privacy.mechanisms import node_noise_source

    sim = partial(node_noise_source, simulated=True, states_limit=False)
    assert sim({}, own_data=True) == "os"  # an organisation's own data: secret noise
    assert sim({}, own_data=False) == "seeded"  # a simulated partition: repeatable
    assert sim({"noise-source": "os"}, own_data=False) == "os"
    assert sim({"noise-source": "seeded"}, own_data=True) == "seeded"  # the organisation decides
    assert sim({"noise-source": "seeded"}, own_data=True, run_choice="os") == "os"  # run config: only stronger
    assert sim({}, own_data=True, run_choice="seeded") == "os"  # ... never weaker
    # a real node, or one that states its own privacy limit, never defaults to regenerable noise
    for simulated, states_limit in ((False, False), (True, True), (False, True)):
        for run_choice in ("auto", "seeded"):
            source = node_noise_source(
                {}, own_data=False, simulated=simulated, states_limit=states_limit, run_choice=run_choice
            )
            assert source == "os", (simulated, states_limit, run_choice)
    # without privacy there is no noise, and batches follow the seed everywhere
    assert node_noise_source({}, own_data=True, simulated=False, states_limit=False, private=False) == "seeded"
    # only its own node config can ask for it (a node with a limit then refuses: client_app.privacy_floor)
    assert node_noise_source({"noise-source": "seeded"}, own_data=False, simulated=False, states_limit=True) == "seeded"
    with pytest.raises(ValueError, match="noise-source='urandom' is not one of seeded, os"):
        sim({"noise-source": "urandom"}, own_data=False)


def test_a_node_is_simulated_only_inside_a_simulation():
    from fedvlm.utils.runtime import in_process_node, simulated

    assert not simulated()  # a plain process: a real node (a pytest process has no Ray actor)
    with in_process_node():
        assert simulated()
    assert not simulated()


def test_os_noise_cannot_be_regenerated_from_the_run_seed():
    from fedvlm.privacy.mechanisms import noise_generator, sampling_rng

    seeded = [torch.randn(8, generator=noise_generator("seeded", [0, 3, 1])) for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1]) and torch.equal(
        seeded[0], torch.randn(8, generator=generator_for([0, 3, 1]))
    )
    secret = [gaussian_noise((8,), 1.0, noise_generator("os", [0, 3, 1])) for _ in range(2)]
    assert not torch.equal(secret[0], secret[1]) and not torch.equal(secret[0], seeded[0])
    assert not np.array_equal(sampling_rng("os", [0, 3]).random(8), sampling_rng("os", [0, 3]).random(8))
    assert np.array_equal(sampling_rng("seeded", [0, 3]).random(8), sampling_rng("seeded", [0, 3]).random(8))


def test_os_noise_comes_from_the_secure_generator_and_is_standard_gaussian(monkeypatch):
    """OS noise is drawn from os.urandom (no seed exists to recover), with the requested std."""
    from scipy import stats

    from fedvlm.privacy import mechanisms

    calls = []
    real = mechanisms.os.urandom
    monkeypatch.setattr(mechanisms.os, "urandom", lambda n: calls.append(n) or real(n))
    draws = gaussian_noise((100_001,), 2.5, mechanisms.noise_generator("os")).double().numpy()
    assert calls == [16 * 50_001]  # 2 x 64 bits per pair of Gaussian draws, all from the OS
    assert abs(draws.std() - 2.5) < 0.03 and abs(draws.mean()) < 0.03
    assert stats.kstest(draws / 2.5, "norm").pvalue > 1e-3


def test_delta_must_be_well_below_one_over_the_records():
    from fedvlm.privacy.accounting import BudgetError, check_delta

    check_delta(1e-5, 10_000, "the federation's", "lower privacy.delta")
    for delta, records in ((1e-5, 10_001), (1.0, 10), (0.5, 1)):
        with pytest.raises(BudgetError, match=r"not well below 1/records.*lower privacy.delta to at most"):
            check_delta(delta, records, "the federation's", "lower privacy.delta")


def test_a_delta_too_large_for_the_audits_canaries_names_the_canaries_first():
    """The audit's canaries are training records of the audited node: with 100,000 of them the
    federation's delta check fails, and the advice names the key that made it fail."""
    from fedvlm.methods.validation import validate
    from fedvlm.privacy.accounting import BudgetError
    from fedvlm.privacy.planner import ClientShape
    from tests.budgets import planned

    cfg = validate({"method": "dpfpl", "privacy.epsilon": 2.0, "privacy.audit-canaries": 100_000})
    shapes = {"a": ClientShape(60_000, 32, 1), "b": ClientShape(200, 32, 1)}
    with pytest.raises(BudgetError, match=r"use fewer privacy.audit-canaries \(100000 now, each a record\) or lower"):
        planned(cfg, shapes)
