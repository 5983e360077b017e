"""Local training steps shared by every prompt method: batch sampling and (private) gradients.

Batches:
- without DP: a fresh permutation per epoch (a partial tail joins the next epoch);
- DP, accountant calibration: Poisson sampling, each record independently with rate q = B/n,
  which is what the accountant's subsampling amplification assumes;
- DP, paper calibration: a uniformly drawn batch of exactly B records per step (the paper's
  code), for which no amplification is claimed.

Gradients (``private_gradients``):
- without DP: the ordinary gradient of the mean loss;
- per-sample clipping: every sample's gradient of every leaf is clipped to C separately, the
  clipped gradients are summed and divided by the expected batch size B (so one record moves
  the result by at most C/B), then leaves that carry local DP get N(0, sigma^2) noise;
- per-batch clipping: the mean-loss gradient of each leaf is clipped to C as a whole, then
  noised (the public code's behaviour; the stated guarantee does not hold).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedvlm.privacy.ledger import PrivacySettings
from fedvlm.privacy.mechanisms import clip_per_sample, clip_tensor, gaussian_noise, per_sample_grads


def batches(n: int, batch_size: int, steps: int, settings: PrivacySettings, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Indices of the batch of each local step (see the module docstring)."""
    bsz = min(batch_size, n)
    if settings.enabled and settings.sampling == "poisson":
        q = batch_size / n if n > batch_size else 1.0
        for _ in range(steps):
            yield np.flatnonzero(rng.random(n) < q)
        return
    if settings.enabled:
        for _ in range(steps):
            yield rng.choice(n, size=bsz, replace=False)
        return
    order = np.empty(0, dtype=np.int64)
    for _ in range(steps):
        if len(order) < bsz:
            order = np.concatenate([order, rng.permutation(n)])
        batch, order = order[:bsz], order[bsz:]
        yield batch


@dataclass
class GradientStats:
    clipped_fraction: float = 0.0
    batch_size: int = 0


def private_gradients(
    losses: torch.Tensor,
    leaves: Mapping[str, torch.Tensor],
    via: Sequence[torch.Tensor],
    settings: PrivacySettings,
    expected_batch: int,
    noise_std: Mapping[str, float],
    generator: torch.Generator,
) -> tuple[dict[str, torch.Tensor], GradientStats]:
    """Gradients of each leaf for one step (see the module docstring).

    ``noise_std[name]`` is the std of the local-DP noise added to leaf ``name``'s gradient
    (0 or absent: none; e.g. the global prompt, which is noised on the server).
    """
    names = list(leaves)
    stats = GradientStats(batch_size=int(losses.shape[0]))
    if losses.shape[0] == 0:  # an empty Poisson batch: the gradient is the noise alone
        grads = {k: torch.zeros_like(v) for k, v in leaves.items()}
    elif not settings.enabled:
        # retain the graph: a method may add a data-independent term through the same features
        g = torch.autograd.grad(losses.mean(), [leaves[k] for k in names], allow_unused=True, retain_graph=True)
        return {k: (gi if gi is not None else torch.zeros_like(leaves[k])) for k, gi in zip(names, g)}, stats
    elif settings.clipping == "per-sample":
        per = per_sample_grads(losses, [leaves[k] for k in names], via)
        grads, fractions = {}, []
        for k, g in zip(names, per):
            clipped, frac = clip_per_sample(g, settings.clip)
            grads[k] = clipped.sum(0) / expected_batch
            fractions.append(frac)
        stats.clipped_fraction = float(np.mean(fractions))
    else:
        g = torch.autograd.grad(losses.mean(), [leaves[k] for k in names], allow_unused=True, retain_graph=True)
        grads, clipped = {}, []
        for k, gi in zip(names, g):
            grads[k], was = clip_tensor(gi if gi is not None else torch.zeros_like(leaves[k]), settings.clip)
            clipped.append(was)
        stats.clipped_fraction = float(np.mean(clipped))
    for k in names:
        std = noise_std.get(k, 0.0)
        if std > 0:
            grads[k] = grads[k] + gaussian_noise(grads[k].shape, std, generator, grads[k].device)
    return {k: v.detach() for k, v in grads.items()}, stats
