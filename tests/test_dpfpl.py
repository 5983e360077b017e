"""DP-FPL: the factorisation, the rebuilt gradient, where noise goes, and what leaves clients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedvlm.strategies.global_local as global_local
from fedvlm.client_app.app import app as client_app
from fedvlm.models.lowrank import factorize, rebuild_gradient
from fedvlm.privacy.accounting import BudgetError
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid


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
        return (torch.sin(prompt) * target).sum() + 0.5 * (prompt ** 2).sum()

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


def _grid(cfg, n):
    return InProcessGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], cfg.as_dict())


def test_private_parts_never_leave_and_server_noise_is_drawn_once_per_round(make_cfg, pretrained_clip, monkeypatch):
    draws = []
    real = global_local.gaussian_noise

    def spy(shape, std, generator, device=None):
        draws.append((tuple(shape), std))
        return real(shape, std, generator, device)

    monkeypatch.setattr(global_local, "gaussian_noise", spy)
    cfg = make_cfg(method="dpfpl", num_server_rounds=3, privacy__epsilon=1.0)
    grid = _grid(cfg, 3)
    rec = execute(cfg, grid, run_id="t")
    sigma = rec.data["privacy"]["mechanisms"]["gdp-global"]["sigma"]
    assert draws == [((16, 96), sigma)] * 3  # once per round, on the average, with the ledger's sigma
    assert [r["metrics"]["gdp-sigma"] for r in rec.data["rounds"]] == [sigma] * 3

    # every tensor that crossed the network, both ways
    down = {k for m in grid.sent if "arrays" in m.content for k in m.content["arrays"].keys()}
    up = {k for m in grid.replies if not m.has_error() and "arrays" in m.content for k in m.content["arrays"].keys()}
    assert down <= {"global_ctx"} and up == {"global_grad"}
    privates = [ctx.state["private"].to_torch_state_dict() for ctx in grid.contexts.values()]
    assert all("local_ctx" in p for p in privates)
    for m in grid.replies:
        if m.metadata.message_type != "train":
            continue
        sent = torch.from_numpy(m.content["arrays"]["global_grad"].numpy())
        for p in privates:
            assert not any(v.shape == sent.shape and torch.allclose(v, sent) for v in p.values())


def test_server_noise_std_matches_the_ledger(make_cfg, pretrained_clip):
    cfg = make_cfg(method="dpfpl", privacy__epsilon=0.05, dpfpl__server_lr=1.0)
    spec = cfg.method
    strategy = spec.strategy_class()(cfg, spec)
    from fedvlm.strategies.base import ClientUpdate, NodeInfo

    strategy.nodes = {i: NodeInfo(i, f"c{i}", i, 64, 24, 0, "x", 40) for i in range(4)}
    strategy.global_arrays = {k: np.asarray(v) for k, v in strategy.initial_arrays().items()}
    strategy.plan_privacy()
    before = strategy.global_arrays["global_ctx"].copy()
    zero = [ClientUpdate(n, {"global_grad": np.zeros((16, 96), np.float32)}, {"num-examples": 64}) for n in strategy.nodes.values()]
    strategy._round = {"sampled": 4}
    strategy.aggregate(1, zero)
    step = before - strategy.global_arrays["global_ctx"]  # sgd, lr 1: exactly the noise
    sigma = strategy.ledger.plans["gdp-global"].sigma
    assert float(step.std()) == pytest.approx(sigma, rel=0.05)  # 1536 draws


def test_noise_costs_accuracy_and_dpfpl_beats_noisy_promptfl(make_cfg, pretrained_clip):
    def final_local(**kw):
        cfg = make_cfg(num_server_rounds=10, **kw)
        return execute(cfg, _grid(cfg, 5), run_id="t").data["final"]["local-acc"]

    clean = final_local(method="dpfpl")
    noisy = final_local(method="dpfpl", privacy__epsilon=0.05)
    promptfl = final_local(method="promptfl", prompt__local_steps=1, privacy__epsilon=0.05)
    assert noisy < clean - 0.05, (clean, noisy)
    assert noisy > promptfl, (noisy, promptfl)


def test_budget_that_the_schedule_would_exceed_refuses_to_start(make_cfg, pretrained_clip):
    cfg = make_cfg(method="dpfpl", privacy__epsilon=0.5, privacy__calibration="paper", privacy__max_epsilon=0.6,
                   num_server_rounds=5)
    with pytest.raises(BudgetError, match="privacy.max-epsilon = 0.6.*num-server-rounds"):
        execute(cfg, _grid(cfg, 2), run_id="t")


def test_a_run_that_reaches_its_budget_stops_cleanly(make_cfg, pretrained_clip):
    cfg = make_cfg(method="dpfpl", privacy__noise_multiplier=1.5, privacy__max_epsilon=1.45, num_server_rounds=30)
    rec = execute(cfg, _grid(cfg, 2), run_id="t")
    run = rec.data["run"]
    assert run["status"] == "stopped" and "privacy budget reached" in run["note"]
    done = len(rec.data["rounds"])
    assert 0 < done < 30
    spent = rec.data["privacy"]["rounds"][-1]
    # the figure budgeted is each record's, local and global composed, and it stays under the cap
    assert spent["epsilon"] == max(spent["per_client"].values()) <= 1.45
    assert max(max(v.values()) if isinstance(v, dict) else v for v in spent["components"].values()) < spent["epsilon"]
