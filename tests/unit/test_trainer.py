"""The one local-training loop (client_app/trainer.py) with both kinds of learner: tensors
(the functional backend) and an nn.Module (Opacus). With clipping that never binds and no
noise, a private step is exactly the ordinary step; with noise, the noise reaches the update."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedvlm.client_app.trainer import Learner, StepOutput, batches, local_round
from fedvlm.privacy.planner import ClientShape
from fedvlm.runconfig.schema import PrivacyConfig
from fedvlm.utils.rng import generator_for

X = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
Y = torch.arange(16) % 3


def _settings(epsilon: float, clip: float = 1e9) -> PrivacyConfig:
    # the paper calibration samples fixed-size batches: with B = n every step sees every record
    return PrivacyConfig(epsilon=epsilon, clip=clip, calibration="paper", noise_multiplier=0.0)


class TensorLearner(Learner):
    """A linear classifier as a bare tensor reaching the losses through its logits' features."""

    def __init__(self):
        self.w = torch.zeros(6, 3, requires_grad=True)
        self.opt = torch.optim.SGD([self.w], lr=0.5)

    def begin_step(self):
        return {"w": self.w}

    def forward(self, batch):
        feats = X[batch] @ self.w  # the "via" tensor: every leaf reaches the losses through it
        losses = nn.functional.cross_entropy(feats, Y[batch], reduction="none")
        return StepOutput(losses, [feats], correct=int((feats.argmax(1) == Y[batch]).sum()))

    def apply(self, grads):
        self.opt.zero_grad()
        self.w.grad = grads["w"]
        self.opt.step()

    def weights(self):
        return self.w.detach().clone()


class ModuleLearner(Learner):
    def __init__(self):
        self.module = self.net = nn.Linear(6, 3)
        nn.init.zeros_(self.module.weight)
        nn.init.zeros_(self.module.bias)
        self.params = dict(self.module.named_parameters())
        self.opt = torch.optim.SGD(list(self.params.values()), lr=0.5)

    def begin_step(self):
        return self.params

    def clip_groups(self, names):
        return (tuple(names),)

    def forward(self, batch):
        logits = self.net(X[batch])
        return StepOutput(
            nn.functional.cross_entropy(logits, Y[batch], reduction="none"),
            correct=int((logits.argmax(1) == Y[batch]).sum()),
        )

    def apply(self, grads):
        for k, p in self.params.items():
            p.grad = grads[k]
        self.opt.step()

    def weights(self):
        return self.module.weight.detach().clone()


@pytest.mark.parametrize("make", [TensorLearner, ModuleLearner], ids=["functional", "module"])
def test_a_private_step_without_binding_clip_or_noise_is_the_ordinary_step(make, monkeypatch):
    shape = ClientShape(16, 16, 3)
    plain, private = make(), make()
    stats = local_round(plain, shape, _settings(0.0), 0.0, np.random.default_rng(0), generator_for([0]))
    dp = local_round(private, shape, _settings(1.0), 0.0, np.random.default_rng(0), generator_for([0]))
    torch.testing.assert_close(private.weights(), plain.weights(), rtol=1e-5, atol=1e-6)
    assert stats.steps == dp.steps == 3 and stats.seen == 48 and stats.losses[0] == pytest.approx(np.log(3))
    assert dp.clipped == [0.0, 0.0, 0.0] and dp.backend == ("functional" if make is TensorLearner else "hooks")
    assert "dp-clipped-fraction" in dp.metrics(16) and "dp-clipped-fraction" not in stats.metrics(16)


@pytest.mark.parametrize("make", [TensorLearner, ModuleLearner], ids=["functional", "module"])
def test_noise_and_clipping_reach_the_update(make):
    shape = ClientShape(16, 16, 1)
    quiet, noisy = make(), make()
    local_round(quiet, shape, _settings(1.0, clip=0.01), 0.0, np.random.default_rng(0), generator_for([0]))
    stats = local_round(noisy, shape, _settings(1.0, clip=0.01), 0.3, np.random.default_rng(0), generator_for([0]))
    # one SGD step of lr 0.5 on N(0, 0.3^2) noise: the update moves by about 0.15 per coordinate
    assert float((noisy.weights() - quiet.weights()).std()) == pytest.approx(0.15, rel=0.5)
    assert float(quiet.weights().norm()) <= 0.5 * 0.01 * 1.0001  # the clipped mean moved it by at most lr * C
    assert stats.clipped == [1.0]


def test_batches_follow_the_sampling_the_accountant_assumes():
    poisson = PrivacyConfig(epsilon=1.0, clip=1.0, noise_multiplier=0.0)
    sizes = [len(b) for b in batches(1000, 50, 400, poisson, np.random.default_rng(0))]
    assert np.mean(sizes) == pytest.approx(50, rel=0.03) and len(set(sizes)) > 5  # Poisson: random sizes
    fixed = [len(b) for b in batches(1000, 50, 10, _settings(1.0), np.random.default_rng(0))]
    assert set(fixed) == {50}
    epochs = np.concatenate(list(batches(10, 4, 5, _settings(0.0), np.random.default_rng(0))))
    assert sorted(epochs[:10]) == list(range(10))  # without DP: every record once per epoch
