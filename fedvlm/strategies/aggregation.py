"""Aggregation rules, as plain functions of numpy arrays (easy to test by hand)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def weighted_average(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """sum_k w_k x_k / sum_k w_k for every tensor name (all updates must hold the same names)."""
    if not updates:
        raise ValueError("nothing to average")
    if len(updates) != len(weights):
        raise ValueError("one weight per update is needed")
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    names = set(updates[0])
    if any(set(u) != names for u in updates):
        raise ValueError("updates hold different tensor names")
    out = {}
    for name in updates[0]:
        acc = np.zeros_like(np.asarray(updates[0][name], dtype=np.float64))
        for u, wk in zip(updates, w, strict=True):
            acc += wk * np.asarray(u[name], dtype=np.float64)
        out[name] = (acc / w.sum()).astype(np.asarray(updates[0][name]).dtype)
    return out


def per_group_average(
    current: Mapping[str, np.ndarray],
    groups: Mapping[str, Sequence[str]],
    updates: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    chosen: Sequence[str],
) -> dict[str, np.ndarray]:
    """FedRand's aggregation (paper eqs. 8-10): the tensors of group g are the weighted average
    over the updates whose ``chosen`` group is g, normalised by those updates' weights only;
    a group that no update chose keeps its ``current`` values."""
    out = {k: np.asarray(v) for k, v in current.items()}
    for group, names in groups.items():
        members = [i for i, g in enumerate(chosen) if g == group]
        if members:
            out.update(
                weighted_average([{k: updates[i][k] for k in names} for i in members], [weights[i] for i in members])
            )
    return out
