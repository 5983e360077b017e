"""LiRA, RMIA and their bootstrap metrics (attacks/likelihood.py), on real trained models: a
softmax classifier that memorised random labels is told apart from one that never trained."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedvlm.attacks.likelihood import bootstrap, lira_offline, lira_online, logit_confidence, rmia, roc_metrics

D, C, N = 32, 4, 40  # features, classes, records per set


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)


def _train(x: torch.Tensor, y: torch.Tensor, steps: int) -> torch.Tensor:
    """A linear softmax classifier; random labels, so what it learns is memorisation."""
    w = torch.zeros(D, C, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(x @ w, y).backward()
        opt.step()
    return w.detach()


def _probs(w: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    return torch.softmax(x @ w, -1).numpy()


REFS = 8


@pytest.fixture(scope="module")
def world():
    """LiRA's setting: a population of 2N records; the target trained on the first N (its
    members); 8 reference models, every record in a random 4 of them."""
    (xm, ym), (xn, yn) = _data(0), _data(1)
    x, y = torch.cat([xm, xn]), torch.cat([ym, yn])
    member = np.r_[np.ones(N, bool), np.zeros(N, bool)]
    rng = np.random.default_rng(0)
    halves = np.zeros((REFS, 2 * N), bool)  # [R, 2N]: record j in reference r; each record in exactly half
    for j in range(2 * N):
        halves[rng.permutation(REFS)[: REFS // 2], j] = True
    refs = [_train(x[h], y[h], steps=100) for h in halves]
    return x, y.numpy(), member, refs, halves


def _scores(target, world):
    x, y, member, refs, halves = world
    p_t = _probs(target, x)
    p_ref = np.stack([_probs(w, x) for w in refs])  # [R, 2N, C]
    phi, phi_ref = logit_confidence(p_t, y), logit_confidence(p_ref, y)
    phi_in, phi_out = np.where(halves, phi_ref, np.nan), np.where(halves, np.nan, phi_ref)
    rows = np.arange(len(y))
    p_x, p_x_out = p_t[rows, y], np.where(halves, np.nan, p_ref[:, rows, y])
    pop = ~member  # population records: the non-members, each compared with all but itself
    x_in_z = np.where(pop, np.cumsum(pop) - 1, -1)
    return {
        "lira-offline": lira_offline(phi, phi_out),
        "lira-online": lira_online(phi, phi_in, phi_out),
        "rmia": rmia(p_x, p_x_out, p_x[pop], p_x_out[:, pop], x_in_z=x_in_z),
    }


def test_every_attack_separates_a_memorising_model_from_an_untrained_one(world):
    x, y, member = world[0], world[1], world[2]
    overfit = _train(x[:N], torch.from_numpy(y[:N]), steps=100)  # trained like the references
    untrained = torch.zeros(D, C)
    for name, scores in _scores(overfit, world).items():
        assert roc_metrics(scores, member)["auc"] > 0.8, name
    for name, scores in _scores(untrained, world).items():
        assert roc_metrics(scores, member)["auc"] == pytest.approx(0.5, abs=0.15), name


def test_rmia_matches_the_worked_example():
    # p(x|target) 0.9, p_out(x) 0.5, a = 0.3: p(x) = 0.675; the four z's ratios give LR 3.42, 1.8, 1.21, 1.29
    z, z_out = np.array([0.2, 0.5, 0.6, 0.9]), np.array([[0.25, 0.5, 0.3, 0.8]])
    assert rmia(np.array([0.9]), np.array([[0.5]]), z, z_out, gamma=2.0).tolist() == [0.25]
    assert rmia(np.array([0.9]), np.array([[0.5]]), z, z_out, gamma=1.0).tolist() == [1.0]


def test_logit_confidence_is_stable_near_certainty():
    probs = np.array([[1 - 1e-12, 1e-12, 0.0], [0.5, 0.25, 0.25]])
    phi = logit_confidence(probs, np.array([0, 0]))
    assert phi[0] == pytest.approx(np.log((1 - 1e-12) / 1e-12), rel=1e-6) and phi[1] == pytest.approx(0.0)


def test_tpr_at_low_fpr_takes_the_step_roc():
    # members {1, 3}, non-members {0, 2}: no threshold below FPR 25% admits more than the top member
    m = roc_metrics(np.array([1.0, 3.0, 0.0, 2.0]), np.array([True, True, False, False]))
    assert m["auc"] == pytest.approx(0.75) and m["tpr@1%fpr"] == 0.5 and m["tpr@0.1%fpr"] == 0.5


def test_bootstrap_intervals_are_reproducible_and_cover_the_estimate():
    rng = np.random.default_rng(0)
    member = np.r_[np.ones(200, bool), np.zeros(200, bool)]
    scores = rng.normal(size=400) + 0.8 * member
    a, b = bootstrap(scores, member, samples=300, seed=7), bootstrap(scores, member, samples=300, seed=7)
    assert a == b  # a fixed seed gives the same intervals
    for k, v in a.items():
        assert v["ci95"][0] <= v["value"] <= v["ci95"][1], k
    assert 0.65 < a["auc"]["ci95"][0] < a["auc"]["value"] < a["auc"]["ci95"][1] < 0.81
    perfect = bootstrap(member.astype(float), member, samples=50, seed=0)
    assert perfect["auc"] == {"value": 1.0, "ci95": [1.0, 1.0], "chance": 0.5, "non-members": 200}


def test_closed_form_metrics_equal_sklearns_roc():
    from sklearn.metrics import roc_auc_score, roc_curve

    rng = np.random.default_rng(1)
    for n_in, n_out in ((50, 1500), (300, 300)):
        member = np.r_[np.ones(n_in, bool), np.zeros(n_out, bool)]
        scores = np.round(rng.normal(size=n_in + n_out) + 0.7 * member, 1)  # rounded: many ties
        fpr, tpr, _ = roc_curve(member, scores)
        m = roc_metrics(scores, member)
        assert m["auc"] == pytest.approx(roc_auc_score(member, scores), abs=1e-12)
        for level in (0.001, 0.01):
            assert m[f"tpr@{100 * level:g}%fpr"] == pytest.approx(tpr[fpr <= level].max(), abs=1e-12)
