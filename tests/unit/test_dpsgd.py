"""The one DP-SGD module (privacy/dpsgd.py): every per-sample backend equals one backward per
record, clipping bounds what one record can move, the noise is the planned one, and a node's
accountant survives being saved."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
import torch
from torch import nn

from fedvlm.models import tiny_clip
from fedvlm.models.prompt_learner import PromptEncoder, TextTower, clip_logits, init_context
from fedvlm.privacy.dpsgd import (
    DPStep,
    ModuleGradients,
    NodeAccountant,
    backend_for,
    functional_per_sample,
    per_sample_clip,
    privatize,
    privatize_batch,
)
from fedvlm.utils.rng import generator_for


def _loop(loss_of, leaves, b):
    """The reference: one backward per record."""
    out = {k: [] for k in leaves}
    for i in range(b):
        g = torch.autograd.grad(loss_of(i), list(leaves.values()), allow_unused=True)
        for (k, leaf), gi in zip(leaves.items(), g, strict=True):
            out[k].append(gi if gi is not None else torch.zeros_like(leaf))
    return {k: torch.stack(v) for k, v in out.items()}


def test_functional_per_sample_gradients_of_a_prompt_equal_the_loop_through_the_real_text_tower():
    torch.manual_seed(0)
    model = tiny_clip.build_tiny_clip().eval().requires_grad_(False)
    tower, tok = TextTower.from_open_clip(model), tiny_clip.tokenizer()
    ctx = init_context(tower, tok, 4, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    encoder = PromptEncoder(tower, tok, ["cat", "dog", "ship", "frog", "truck"], 4)
    other = (torch.randn_like(ctx) * 0.02).requires_grad_(True)  # a second leaf (e.g. a local prompt)
    with torch.no_grad():
        dim = encoder(ctx).shape[1]
    feats = torch.nn.functional.normalize(torch.randn(6, dim), dim=-1)
    labels = torch.tensor([0, 1, 2, 3, 4, 0])

    def losses_of():
        text = encoder(ctx + other)
        return nn.functional.cross_entropy(clip_logits(feats, text, 50.0), labels, reduction="none"), text

    losses, text = losses_of()
    ref = _loop(lambda i: losses_of()[0][i], {"ctx": ctx, "other": other}, 6)
    for chunk in (1, 4, 6):  # one record per VJP, the CPU's chunks (4 + 2), all at once
        per = functional_per_sample(losses, {"ctx": ctx, "other": other}, [text], chunk=chunk)
        for k in ("ctx", "other"):
            assert per[k].shape == (6, *ctx.shape)
            # float32 sums in another order: equal to 1e-5 of the gradient's scale
            assert float((per[k] - ref[k]).abs().max()) <= 1e-5 * float(ref[k].abs().max()), (chunk, k)


class _Parallel(nn.Module):
    """Layers Opacus has rules for (Linear, LayerNorm) around an in-place residual addition."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3)

    def forward(self, x):
        h = self.norm(self.a(x))
        h += torch.tanh(h)  # in place
        return self.b(h)


class _Factors(nn.Module):
    """A layer keeping its trainable factors in a ParameterDict (like peft's LoHa)."""

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterDict({"u": nn.Parameter(torch.randn(5, 2)), "v": nn.Parameter(torch.randn(2, 3))})

    def forward(self, x):
        return x @ (self.w["u"] @ self.w["v"])


class _Program(nn.Module):
    """A custom layer using its own parameter (like reprogramming's input program): Opacus
    takes its per-sample gradients by vmap over the layer's forward."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.randn(5))
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(x + torch.tanh(self.theta))


@pytest.mark.parametrize(
    "module,backend",
    [
        (nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), "hooks"),
        (_Program(), "hooks"),
        (_Parallel(), "expanded"),
        (_Factors(), "microbatch"),
    ],
)
def test_every_module_backend_equals_one_backward_per_record(module, backend):
    torch.manual_seed(1)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    leaves = {k: p for k, p in module.named_parameters()}

    def losses(idx, net=module):
        return nn.functional.cross_entropy(net(x[torch.as_tensor(idx)]), y[torch.as_tensor(idx)], reduction="none")

    ref = _loop(lambda i: losses([i]).sum(), leaves, 8)
    grads = ModuleGradients(module, backend)
    net = grads.attach()
    try:
        idx = np.arange(8)
        per = grads.per_sample(leaves, losses, idx, losses(idx, net) if backend != "microbatch" else None)
    finally:
        grads.detach()
    for k in leaves:
        torch.testing.assert_close(per[k], ref[k], rtol=1e-5, atol=1e-6)
    assert all(not hasattr(p, "grad_sample") and p.grad is None for p in module.parameters())  # left as it was


def test_backend_choice_follows_what_opacus_can_hook():
    assert backend_for(nn.Sequential(nn.Linear(2, 2))) == "hooks"
    assert backend_for(_Program()) == "hooks"
    assert backend_for(_Factors()) == "microbatch"
    declared = nn.Linear(2, 2)
    declared.per_sample_backend = "expanded"
    assert backend_for(declared) == "expanded"


def test_per_sample_clipping_bounds_every_record():
    g = torch.randn(16, 3, 5) * torch.linspace(0.1, 30, 16).view(-1, 1, 1)
    clipped, was = per_sample_clip(g, 10.0)
    assert (clipped.reshape(16, -1).norm(dim=1) <= 10.0 + 1e-5).all()
    small = g.reshape(16, -1).norm(dim=1) <= 10
    torch.testing.assert_close(clipped[small], g[small])  # small gradients untouched
    assert torch.equal(was, ~small)


def test_one_record_moves_each_group_by_at_most_clip_over_b():
    """Add-or-remove-one sensitivity of the released sum / B, per clip group: C / B."""
    shapes = {"a": torch.Size([4, 3]), "b": torch.Size([2]), "c": torch.Size([5])}
    per = {k: torch.randn(10, *s) * 50 for k, s in shapes.items()}
    step = DPStep(clip=1.0, expected_batch=8, sigma=0.0, groups=(("a", "b"), ("c",)), noised=frozenset())
    full, _ = privatize(per, step, generator_for([0]), shapes)
    fewer, _ = privatize({k: v[1:] for k, v in per.items()}, step, generator_for([0]), shapes)
    joint = torch.cat([(full[k] - fewer[k]).flatten() for k in ("a", "b")]).norm()
    assert float(joint) == pytest.approx(1.0 / 8, rel=1e-5)  # the removed record was clipped to C exactly
    assert float((full["c"] - fewer["c"]).norm()) == pytest.approx(1.0 / 8, rel=1e-5)


def test_noise_is_added_to_the_noised_tensors_only_with_the_planned_std():
    shapes = {"local": torch.Size([200, 100]), "global": torch.Size([200, 100])}
    zeros = {k: torch.zeros(3, *s) for k, s in shapes.items()}
    step = DPStep(1.0, 4, sigma=0.37, groups=(("global",), ("local",)), noised=frozenset({"local"}))
    out, _ = privatize(zeros, step, generator_for([1, 2]), shapes)
    assert torch.count_nonzero(out["global"]) == 0
    assert float(out["local"].std()) == pytest.approx(0.37, rel=0.02)
    again, _ = privatize(zeros, step, generator_for([1, 2]), shapes)
    assert torch.equal(out["local"], again["local"])  # seeded: repeatable


def test_an_empty_poisson_batch_releases_the_noise_alone():
    shapes = {"w": torch.Size([50, 50])}
    step = DPStep(1.0, 4, sigma=0.5, groups=(("w",),), noised=frozenset({"w"}))
    out, frac = privatize({"w": torch.zeros(0, 50, 50)}, step, generator_for([3]), shapes)
    assert out["w"].shape == (50, 50) and float(out["w"].std()) == pytest.approx(0.5, rel=0.05) and frac == 0.0


def test_per_batch_clipping_clips_each_group_as_a_whole():
    grads = {"a": torch.full((4,), 10.0), "b": torch.full((4,), 0.1)}
    step = DPStep(1.0, 4, sigma=0.0, groups=(("a",), ("b",)), noised=frozenset(), per_batch=True)
    out, frac = privatize_batch(grads, step, generator_for([0]))
    assert float(out["a"].norm()) == pytest.approx(1.0) and torch.equal(out["b"], grads["b"]) and frac == 0.5


def test_node_accountant_continues_from_the_ledgers_releases_and_matches_an_independent_accountant():
    restored = NodeAccountant([(1.1, 0.05, 30)])  # the node's ledger: one earlier round of 30 steps
    restored.step(1.1, 0.05, 20)
    whole = NodeAccountant()
    whole.step(1.1, 0.05, 50)
    assert restored.rdp.history == whole.rdp.history == [(1.1, 0.05, 50)]
    eps = restored.epsilon(1e-5)
    ref = dp_accounting.rdp.RdpAccountant()
    ref.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)), 50
        )
    )
    assert eps["rdp"] == pytest.approx(ref.get_epsilon(1e-5), rel=2e-2)
    assert 0 < eps["prv"] <= eps["rdp"] * 1.01
    assert NodeAccountant().epsilon(1e-5) == {"rdp": 0.0, "prv": 0.0}


def _step(sigma: float = 0.5) -> tuple[DPStep, dict, dict]:
    shapes = {"a": torch.Size([16, 64])}
    step = DPStep(1.0, 8, sigma, (("a",),), frozenset({"a"}))
    per_sample = {"a": torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(1)) * 3}  # norms ~96 >> C
    return step, per_sample, shapes


def test_a_step_that_stops_clipping_refuses_to_release(monkeypatch):
    from fedvlm.privacy import dpsgd

    step, per_sample, shapes = _step()
    privatize(per_sample, step, generator_for([1]), shapes)  # the real mechanism passes its own check
    monkeypatch.setattr(dpsgd, "per_sample_clip", lambda g, clip: (g, torch.zeros(g.shape[0], dtype=torch.bool)))
    with pytest.raises(dpsgd.MechanismError, match=r"above the clip norm 1: the mechanism did not clip"):
        privatize(per_sample, step, generator_for([1]), shapes)


@pytest.mark.parametrize("factor", [0.5, 0.8, 2.0])
def test_a_step_that_noises_other_than_planned_refuses_to_release(monkeypatch, factor):
    from fedvlm.privacy import dpsgd

    step, per_sample, shapes = _step()
    real = dpsgd.gaussian_noise
    for seed in range(20):  # the check passes the planned noise every time (false alarm 1e-12)
        privatize(per_sample, step, generator_for([seed]), shapes)
    monkeypatch.setattr(dpsgd, "gaussian_noise", lambda *a, **k: real(*a, **k) * factor)
    with pytest.raises(dpsgd.MechanismError, match="not the planned 0.5"):
        privatize(per_sample, step, generator_for([1]), shapes)


def _two_tensors() -> tuple[DPStep, dict, dict]:
    """A prompt-sized tensor and a 10-coordinate one (Reprogrammable-FL's output bias, a gate's)
    noised in one step, each its own group."""
    shapes = {"ctx": torch.Size([16, 512]), "bias": torch.Size([10])}
    step = DPStep(1.0, 8, 0.5, (("ctx",), ("bias",)), frozenset({"ctx", "bias"}))
    g = torch.Generator().manual_seed(2)
    per_sample = {k: torch.randn(8, *shape, generator=g) for k, shape in shapes.items()}
    return step, per_sample, shapes


@pytest.mark.parametrize("target, factor", [("bias", 0.0), ("ctx", 0.0), ("bias", 0.01), ("ctx", 0.9), ("ctx", 1.1)])
def test_each_noised_tensor_is_checked_on_its_own(monkeypatch, target, factor):
    """One tensor released with less (or no) noise is not lost among the other's coordinates: the
    whole step pooled, a 10-coordinate tensor without noise moved the sum of squares by 0.1%."""
    from fedvlm.privacy import dpsgd

    step, per_sample, shapes = _two_tensors()
    real = dpsgd.gaussian_noise
    for seed in range(50):  # the planned noise passes every time
        privatize(per_sample, step, generator_for([seed]), shapes)

    def scaled(shape, sigma, noise, device=None):
        drawn = real(shape, sigma, noise, device)
        return drawn * factor if tuple(shape) == tuple(shapes[target]) else drawn

    monkeypatch.setattr(dpsgd, "gaussian_noise", scaled)
    why = "adds no noise at all to" if factor == 0 else "not the planned 0.5"
    with pytest.raises(dpsgd.MechanismError, match=f"{why}.*{target}|{target}.*{why}"):
        privatize(per_sample, step, generator_for([3]), shapes)


def test_what_each_size_catches():
    """The power docs/privacy.md states: per step, a scale the check refuses with probability
    0.99 (one of two tensors)."""
    from fedvlm.privacy.noise_check import detectable_scale

    small, prompt = detectable_scale(10, 2), detectable_scale(16 * 512, 2)
    assert 0.02 < small[0] < 0.03 and 5 < small[1] < 6  # a 10-coordinate tensor: gross deviations only
    assert 0.92 < prompt[0] < 0.935 and 1.07 < prompt[1] < 1.08  # a 16x512 prompt: 8% off
    assert detectable_scale(10**6)[0] > 0.99


def test_the_servers_release_is_checked_before_it_leaves(monkeypatch):
    from fedvlm.methods.validation import validate
    from fedvlm.privacy import budget as budget_module
    from fedvlm.privacy.noise_check import MechanismError
    from fedvlm.privacy.planner import ClientShape
    from tests.budgets import planned

    cfg = validate({"method": "dpfpl", "privacy.epsilon": 2.0, "num-server-rounds": 2})
    budget = planned(cfg, {"a": ClientShape(200, 32, 1), "b": ClientShape(200, 32, 1)})
    mean = torch.zeros(16, 64)
    released, sigma = budget.release_global(mean, [0, 1], {})
    assert sigma > 0 and float(released.std()) == pytest.approx(sigma, rel=0.1)
    monkeypatch.setattr(budget_module, "gaussian_noise", lambda shape, sigma, gen: torch.zeros(shape))
    with pytest.raises(MechanismError, match="the server's release adds no noise at all"):
        budget.release_global(mean, [0, 1], {})
