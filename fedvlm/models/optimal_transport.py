"""Entropic unbalanced optimal transport (Sinkhorn-Knopp with KL-relaxed marginals).

FedOTP matches an image's patch embeddings to a class's prompts (its global and its local
prompt) by optimal transport; the class score is the similarity weighted by the transport
plan. Unbalanced: the marginals are enforced only softly (a KL penalty of weight ``tau``),
so a patch that matches no prompt need not be transported in full. ``tau = inf`` gives the
balanced problem. The plan is computed without gradient, as in FedOTP; gradients flow
through the similarities it weights.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def unbalanced_sinkhorn(
    cost: torch.Tensor, eps: float = 0.1, tau: float = 1.0, iters: int = 100, tol: float = 1e-4
) -> torch.Tensor:
    """Transport plans [..., P, N] for costs [..., P, N] between uniform marginals; stops
    early once the scalings change by less than ``tol`` (checked every 10 iterations)."""
    if cost.numel() == 0:  # no image (an empty Poisson batch): nothing to transport, and no error
        return torch.zeros_like(cost)
    *batch, p, n = cost.shape
    a = torch.full((*batch, p), 1.0 / p, dtype=cost.dtype, device=cost.device)
    b = torch.full((*batch, n), 1.0 / n, dtype=cost.dtype, device=cost.device)
    log_k = -cost / eps
    fi = 1.0 if math.isinf(tau) else tau / (tau + eps)
    log_u = torch.zeros_like(a)
    log_v = torch.zeros_like(b)
    for it in range(iters):  # in the log domain for stability
        prev = log_u
        log_u = fi * (a.log() - torch.logsumexp(log_k + log_v.unsqueeze(-2), dim=-1))
        log_v = fi * (b.log() - torch.logsumexp(log_k + log_u.unsqueeze(-1), dim=-2))
        if it % 10 == 9 and float((log_u - prev).abs().max()) < tol:
            break
    return torch.exp(log_u.unsqueeze(-1) + log_k + log_v.unsqueeze(-2))
