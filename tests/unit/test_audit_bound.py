"""The one-run audit's epsilon lower bound (privacy/audit.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedvlm.privacy.audit import AuditInputError, epsilon_lower_bound, guess_p_value

# (canaries m, guesses r, correct v, delta, confidence) -> epsilon lower bound. Computed with the
# algorithm of the paper's appendix (the reference implementation); its own worked numbers could
# not be read here (docs/research/privacy-audit-maths.md, section 1.3).
VECTORS = [
    (10, 5, 5, 0.0, 0.95, 0.197763),
    (100, 10, 10, 1e-5, 0.95, 1.048237),
    (1000, 100, 100, 1e-5, 0.95, 3.465376),
    (1000, 100, 90, 1e-5, 0.95, 1.626143),
    (1000, 200, 150, 1e-5, 0.99, 0.711296),
    (1000, 1000, 900, 1e-5, 0.95, 2.020646),
    (1000, 1000, 600, 1e-5, 0.95, 0.297227),
    (50000, 1000, 1000, 1e-5, 0.95, 4.276446),
    (100000, 10, 10, 1e-5, 0.95, 0.0),
]


# The paper's own worked examples (its Appendix D), as restated to the printed digits by two
# independent code bases that quote it; the paper's full text could not be read here
# (docs/research/privacy-audit-maths.md).
PAPER_EXAMPLES = [
    (100, 100, 75, 0.0, 0.702),
    (100, 100, 75, 1e-4, 0.699),
    (1000, 100, 75, 1e-4, 0.673),
]


@pytest.mark.parametrize("m,r,v,delta,printed", PAPER_EXAMPLES)
def test_bound_matches_the_papers_worked_examples(m, r, v, delta, printed):
    assert round(epsilon_lower_bound(m, r, v, delta, 0.95), 3) == printed


def test_p_value_matches_the_papers_worked_example():
    # 75 of 100 guesses right is what randomised response at epsilon = ln 3 expects: p-value 0.553
    assert round(guess_p_value(100, 100, 75, math.log(3), 0.0), 3) == 0.553


@pytest.mark.parametrize("m,r,v,delta,confidence,expected", VECTORS)
def test_bound_matches_the_reference_algorithm(m, r, v, delta, confidence, expected):
    assert epsilon_lower_bound(m, r, v, delta, confidence) == pytest.approx(expected, abs=2e-6)


def test_p_values_match_the_reference_algorithm():
    assert guess_p_value(1000, 100, 100, 1.0, 1e-5) == pytest.approx(5.633089840961709e-04, rel=1e-9)
    assert guess_p_value(1000, 1000, 600, 0.2, 0.0) == pytest.approx(7.652334289671225e-04, rel=1e-9)
    assert guess_p_value(1000, 1000, 600, 0.2, 1e-5) == pytest.approx(1.0232412152254599e-03, rel=1e-9)


@pytest.mark.parametrize("r", [10, 100, 1000])
def test_all_guesses_right_without_delta_is_randomised_responses_closed_form(r):
    # P[all r right] = q^r = 0.05  =>  eps = logit(0.05^(1/r))
    q = 0.05 ** (1 / r)
    assert epsilon_lower_bound(r, r, r, 0.0) == pytest.approx(math.log(q / (1 - q)), abs=1e-9)


def test_bound_grows_with_correct_guesses_and_falls_with_more_canaries_at_fixed_delta():
    by_correct = [epsilon_lower_bound(1000, 1000, v, 1e-5) for v in (500, 600, 800, 950, 1000)]
    assert by_correct[0] == 0.0 and by_correct == sorted(by_correct) and len(set(by_correct)) == 5
    by_canaries = [epsilon_lower_bound(m, 100, 100, 1e-5) for m in (1000, 10_000, 100_000)]
    assert by_canaries == sorted(by_canaries, reverse=True)


def test_an_honest_mechanism_is_rarely_caught_and_a_broken_one_always():
    """Randomised response at epsilon 1 is exactly as good as a 1-DP mechanism allows: the bound
    exceeds 1 in at most about 5% of audits (95% confidence). A guesser that is always right
    (the noise switched off) exceeds a claimed epsilon of 1 every time."""
    rng = np.random.default_rng(0)
    eps, m, trials = 1.0, 1000, 300
    q = math.exp(eps) / (1 + math.exp(eps))
    bounds = [epsilon_lower_bound(m, m, int(rng.binomial(m, q)), 0.0) for _ in range(trials)]
    caught = sum(b > eps for b in bounds) / trials
    assert caught <= 0.08, caught
    assert 0.3 < float(np.median(bounds)) < eps  # the bound is informative, not trivially 0
    assert epsilon_lower_bound(m, m, m, 1e-5) > 5 * eps


@pytest.mark.parametrize(
    "args,match",
    [
        ((10, 5, 6, 0.0), "correct=6, guesses=5"),
        ((10, 11, 5, 0.0), "guesses=11, canaries=10"),
        ((10, 5, 5, 1.0), "delta must be in"),
    ],
)
def test_impossible_counts_are_refused_with_the_wrong_one_named(args, match):
    with pytest.raises(AuditInputError, match=match):
        epsilon_lower_bound(*args)
    with pytest.raises(AuditInputError, match="confidence"):
        epsilon_lower_bound(10, 5, 5, 0.0, confidence=1.0)


def test_the_audit_is_judged_once_at_the_runs_last_round():
    """Judged at every round, a DP-FPL run at epsilon 0.1 logged BROKEN from round 26 to 60 (a
    bound of 0.078 against 0.048 accounted) and ended consistent: the 95% holds for one look.
    Before the last round the status is interim; the last round's is the verdict."""
    from types import SimpleNamespace

    from fedvlm.privacy.audit import AUDIT_PREFIX, audit_section

    def at(rnd: int, lower: float) -> dict:
        figures = {
            "canaries": 100,
            "guesses": 25,
            "correct": 19,
            "guessed-in": 13,
            "epsilon-lower": lower,
            "steps": rnd,
        }
        return {"round": rnd, "clients": {"client-0": {AUDIT_PREFIX + k: v for k, v in figures.items()}}}

    mechanism = SimpleNamespace(name="ldp-lowrank", where="client")
    spent = {"spent": {"client-0": 0.06}, "spent_components": {"ldp-lowrank": {"client-0": 0.048}}}
    interim = audit_section([at(26, 0.078)], spent, mechanism, "gdp-global", end=(100, "client-0"))
    assert interim is not None and interim["nodes"]["client-0"]["status"].startswith("interim (round 26 of 100)")
    final = audit_section([at(26, 0.078), at(100, 0.078)], spent, mechanism, "gdp-global", end=(100, "client-0"))
    assert final is not None and final["nodes"]["client-0"]["status"].startswith("BROKEN")
    kept = audit_section([at(100, 0.03)], spent, mechanism, "gdp-global", end=(100, "client-0"))
    assert kept is not None and kept["nodes"]["client-0"]["status"].startswith("consistent")
    # the audited node not sampled in the last rounds: its latest audit is its last, and judged
    unsampled = audit_section(
        [at(90, 0.03), {"round": 100, "clients": {}}], spent, mechanism, "x", end=(100, "client-0")
    )
    assert unsampled is not None and unsampled["nodes"]["client-0"]["status"].startswith("consistent")
    # another node's made-up figures (a bound of 1e9) or a partial set are not the audit
    forged = at(100, 0.03)
    forged["clients"]["client-1"] = {**forged["clients"]["client-0"], AUDIT_PREFIX + "epsilon-lower": 1e9}
    section = audit_section([forged], spent, mechanism, "x", end=(100, "client-0"))
    assert section is not None and list(section["nodes"]) == ["client-0"]
    assert section["nodes"]["client-0"]["status"].startswith("consistent")
    assert audit_section([forged], spent, mechanism, "x", end=(100, "client-1")) is not None  # its own, if audited
    partial = {"round": 100, "clients": {"client-0": {AUDIT_PREFIX + "epsilon-lower": 9.0}}}
    assert audit_section([partial], spent, mechanism, "x", end=(100, "client-0")) is None
    assert audit_section([at(100, 0.03)], spent, mechanism, "x", end=(100, None)) is None
