"""Likelihood-ratio membership attacks from reference models, and their metrics with bootstrap
intervals (the maths and its sources: docs/research/privacy-audit-maths.md, sections 2 to 4).

Every attack scores a record x (with its label y) under the target model and under reference
models (shadow models the attacker trained itself), higher = more likely a member:

- LiRA (Carlini et al., S&P 2022) on the logit-scaled confidence phi = log p_y - log(1 - p_y):
  offline (references that never saw x): Lambda = Phi((phi_target - mu_out) / sigma_out), the
  one-sided test of the paper's Eq. (4); online (references with x in and with x out):
  log N(phi; mu_in, sigma_in) - log N(phi; mu_out, sigma_out). Means per record (the median over
  references, as the reference code); with fewer than 64 references the variance is global
  (pooled residuals over all records, the paper's section VI-B).
- RMIA (Zarifzadeh, Liu and Shokri, ICML 2024): the likelihood ratio of x against population
  records z, LR(x, z) = [p(x|target)/p(x)] / [p(z|target)/p(z)], p(.) the mean over references
  (offline: p(x) = ((1 + a) p_out(x) + (1 - a)) / 2); the score is the fraction of z with
  LR(x, z) > gamma.

Metrics (``roc_metrics``): ROC AUC, the best TPR at FPR <= 0.1% and <= 1% (the step ROC, no
interpolation beyond the observed thresholds), and ``bootstrap`` 95% percentile intervals:
members and non-members resampled separately at their own sizes, 1000 times, from a fixed seed.

Each figure carries its own chance level (``chance``): what a score that ignores the model
expects from the same counts. With n non-members, "FPR <= x" admits k = floor(x n) false
positives, and a member outranks the (k+1)-th highest of n exchangeable non-member scores with
probability (k + 1) / (n + 1). Below 1 / x non-members k is 0, the figure is the TPR at zero false
positives, and its chance is 1 / (n + 1), not x: 0.97% with 100 non-members at "0.1% FPR".
"""

from __future__ import annotations

import numpy as np
from scipy.stats import norm, rankdata

GLOBAL_VARIANCE_BELOW = 64  # references: fewer than this, one variance for all records (LiRA VI-B)
FPRS = (0.001, 0.01)


def logit_confidence(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """phi = log p_y - log(sum of the other probabilities), stable for p_y near 1. [..., n, C] -> [..., n]."""
    probs = np.asarray(probs, dtype=np.float64)
    at = np.broadcast_to(np.asarray(labels)[:, None], (*probs.shape[:-1], 1))
    true = np.take_along_axis(probs, at, axis=-1)[..., 0]
    rest = probs.sum(-1) - true
    return np.log(true + 1e-45) - np.log(rest + 1e-45)


def _fit(ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-record means (median over the references [R, n]; NaN where a reference does not
    count for that record) and standard deviations."""
    mu = np.nanmedian(ref, axis=0)
    if ref.shape[0] < GLOBAL_VARIANCE_BELOW:
        sd = np.full(ref.shape[1], np.nanstd(ref - mu) + 1e-30)
    else:
        sd = np.nanstd(ref, axis=0) + 1e-30
    return mu, sd


def lira_offline(phi: np.ndarray, phi_out: np.ndarray) -> np.ndarray:
    """Offline LiRA: phi [n] under the target, phi_out [R, n] under references without x (NaN
    where a reference trained on x)."""
    mu, sd = _fit(np.atleast_2d(phi_out))
    return norm.logcdf((phi - mu) / sd)


def lira_online(phi: np.ndarray, phi_in: np.ndarray, phi_out: np.ndarray) -> np.ndarray:
    """Online LiRA: references with x in ([R, n], NaN where they did not train on x) and out
    (likewise, NaN where they did)."""
    mu_in, sd_in = _fit(np.atleast_2d(phi_in))
    mu_out, sd_out = _fit(np.atleast_2d(phi_out))
    return norm.logpdf(phi, mu_in, sd_in) - norm.logpdf(phi, mu_out, sd_out)


def rmia(
    p_x: np.ndarray,
    p_x_out: np.ndarray,
    p_z: np.ndarray,
    p_z_out: np.ndarray,
    gamma: float = 2.0,
    a: float = 0.3,
    x_in_z: np.ndarray | None = None,
) -> np.ndarray:
    """Offline RMIA. p_x [n]: each record's true-label probability under the target; p_x_out
    [R, n]: under references without it (NaN where a reference trained on it); p_z [k], p_z_out
    [R, k]: the population records'.
    ``x_in_z`` [n] (optional): index of x within z where x is itself a population record (it is
    then not compared with itself)."""
    prior_x = ((1 + a) * np.nanmean(np.atleast_2d(p_x_out), axis=0) + (1 - a)) / 2
    prior_z = ((1 + a) * np.nanmean(np.atleast_2d(p_z_out), axis=0) + (1 - a)) / 2
    ratio_x = p_x / prior_x  # [n]
    ratio_z = p_z / prior_z  # [k]
    dominates = ratio_x[:, None] / ratio_z[None, :] > gamma  # [n, k]
    count = dominates.sum(1).astype(np.float64)
    total = np.full(len(p_x), float(len(p_z)))
    if x_in_z is not None:
        own = x_in_z >= 0
        rows = np.flatnonzero(own)
        count[rows] -= dominates[rows, x_in_z[own]]
        total[own] -= 1
    return count / np.maximum(total, 1)


def roc_metrics(scores: np.ndarray, member: np.ndarray) -> dict[str, float]:
    """AUC (Mann-Whitney, ties counted half) and the best TPR at FPR <= 0.1% and <= 1% of the
    rule "member if score >= t" (higher score = member). Closed forms, so that a bootstrap of a
    thousand replicates stays cheap; equal to sklearn's ``roc_auc_score`` and step ``roc_curve``."""
    scores, member = np.asarray(scores, dtype=np.float64), np.asarray(member, dtype=bool)
    n_in, n_out = int(member.sum()), int((~member).sum())
    if not n_in or not n_out:
        raise ValueError("membership metrics need both members and non-members")
    ranks = rankdata(scores)
    out = {"auc": float((ranks[member].sum() - n_in * (n_in + 1) / 2) / (n_in * n_out))}
    s_in, s_out = scores[member], -np.sort(-scores[~member])  # non-members, highest first
    for level in FPRS:
        allowed = admitted(level, n_out)
        # the lowest threshold admitting at most that many: just above the next non-member score
        tpr = 1.0 if allowed >= n_out else float(np.mean(s_in > s_out[allowed]))
        out[f"tpr@{100 * level:g}%fpr"] = tpr
    return out


def admitted(level: float, n_out: int) -> int:
    """The false positives "FPR <= level" admits among ``n_out`` non-members."""
    return int(np.floor(level * n_out + 1e-9))


def chance(metric: str, n_out: int) -> float:
    """The expected value of ``metric`` (a key of ``roc_metrics``) for a score independent of
    membership, with ``n_out`` non-members (the module's docstring derives it)."""
    if metric == "auc":
        return 0.5
    level = next(lv for lv in FPRS if metric == f"tpr@{100 * lv:g}%fpr")
    return min(1.0, (admitted(level, n_out) + 1) / (n_out + 1))


def bootstrap(scores: np.ndarray, member: np.ndarray, samples: int = 1000, seed: int = 0) -> dict[str, dict]:
    """Each metric of ``roc_metrics`` with its 95% percentile interval (members and non-members
    resampled separately, with replacement, at their own sizes), its chance level and the
    non-members it was measured on."""
    scores, member = np.asarray(scores, dtype=np.float64), np.asarray(member, dtype=bool)
    point = roc_metrics(scores, member)
    rng = np.random.default_rng(seed)
    ins, outs = np.flatnonzero(member), np.flatnonzero(~member)
    draws: dict[str, list[float]] = {k: [] for k in point}
    for _ in range(samples):
        pick = np.r_[rng.choice(ins, len(ins)), rng.choice(outs, len(outs))]
        for k, v in roc_metrics(scores[pick], member[pick]).items():
            draws[k].append(v)
    n_out = len(outs)
    return {
        k: {
            "value": point[k],
            "ci95": [float(q) for q in np.quantile(draws[k], [0.025, 0.975])],
            "chance": chance(k, n_out),
            "non-members": n_out,
        }
        for k in point
    }
