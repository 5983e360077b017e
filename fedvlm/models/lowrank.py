"""DP-FPL's factorisation of the local prompt and the rebuild of its gradient (RGP style).

Every local step the full-rank local prompt p_L (m x n: context tokens x width) is split by
one power iteration of rank k:

    v0 ~ N(0, 1)              (n x k)
    u  = orth(p_L v0)         (m x k, orthonormal columns)
    v  = orth(p_L^T u)^T      (k x n, orthonormal rows)
    r  = p_L - u v            (the residual; a constant in the forward pass)

and its gradient is rebuilt from the (noised) gradients of u and v by the paper's eq. 4,
WITH the minus sign (the public code has a plus sign and an extra 1/10: both bugs):

    grad p_L = (grad u) v + u (grad v) - u u^T (grad u) v

Without noise this equals P_u G + G P_v - P_u G P_v of the true gradient G, with the
projections P_u = u u^T and P_v = v^T v (tests check both facts).
"""

from __future__ import annotations

import torch


def factorize(
    p_local: torch.Tensor, rank: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, v, r) with p_local = u v + r; see the module docstring."""
    m, n = p_local.shape
    if not 1 <= rank <= min(m, n):
        raise ValueError(f"rank must be in 1..{min(m, n)} for a {m}x{n} local prompt, got {rank}")
    p = p_local.detach()
    v0 = torch.randn(n, rank, generator=generator).to(p.device, p.dtype)
    u, _ = torch.linalg.qr(p @ v0)  # m x k
    v_t, _ = torch.linalg.qr(p.t() @ u)  # n x k
    v = v_t.t().contiguous()
    return u.contiguous(), v, p - u @ v


def rebuild_gradient(grad_u: torch.Tensor, grad_v: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """DP-FPL eq. 4: grad p_L = (grad u) v + u (grad v) - u u^T (grad u) v."""
    return grad_u @ v + u @ grad_v - u @ (u.t() @ grad_u) @ v
