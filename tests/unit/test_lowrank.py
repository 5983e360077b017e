"""DP-FPL's low-rank factorisation and its rebuilt gradient (fedvlm/models/lowrank.py)."""

from __future__ import annotations

import pytest
import torch

from fedvlm.models.lowrank import factorize, rebuild_gradient


@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_factorisation_properties(rank):
    p = torch.randn(16, 96, dtype=torch.float64)
    u, v, r = factorize(p, rank, torch.Generator().manual_seed(rank))
    assert u.shape == (16, rank) and v.shape == (rank, 96)
    torch.testing.assert_close(u.t() @ u, torch.eye(rank, dtype=p.dtype))  # orthonormal columns
    torch.testing.assert_close(v @ v.t(), torch.eye(rank, dtype=p.dtype))  # orthonormal rows
    torch.testing.assert_close(u @ v + r, p, rtol=0, atol=1e-12)  # exact reconstruction


def test_rebuilt_gradient_is_the_projection_of_the_true_gradient():
    torch.manual_seed(0)
    p_local = torch.randn(16, 32, dtype=torch.float64)
    target = torch.randn(16, 32, dtype=torch.float64)
    u, v, r = factorize(p_local, 4, torch.Generator().manual_seed(1))
    u_, v_ = u.clone().requires_grad_(True), v.clone().requires_grad_(True)

    def loss_of(prompt):
        return (torch.sin(prompt) * target).sum() + 0.5 * (prompt**2).sum()

    loss_of(u_ @ v_ + r).backward()
    true_g = torch.autograd.functional.jacobian(loss_of, u @ v + r)  # G at the forward prompt
    rebuilt = rebuild_gradient(u_.grad, v_.grad, u, v)
    p_u, p_v = u @ u.t(), v.t() @ v
    torch.testing.assert_close(rebuilt, p_u @ true_g + true_g @ p_v - p_u @ true_g @ p_v)
    # and the minus sign matters: the public code's "+" gives something else
    plus = u_.grad @ v + u @ v_.grad + u @ (u.t() @ u_.grad) @ v
    assert not torch.allclose(plus, rebuilt)


def test_full_rank_rebuild_is_the_true_gradient():
    p = torch.randn(8, 8, dtype=torch.float64)
    u, v, _ = factorize(p, 8, torch.Generator().manual_seed(0))
    g = torch.randn(8, 8, dtype=torch.float64)
    torch.testing.assert_close(rebuild_gradient(g @ v.t(), u.t() @ g, u, v), g)
