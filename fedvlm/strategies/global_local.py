"""Server side of the global/local prompt methods (DP-FPL, FedOTP, FedPGP).

Each round the sampled clients return the clipped gradient of the global prompt. The server
averages them over a fixed denominator: the number of clients sampled at planning, or this
round's sample if larger (a dropped reply or a lost node lowers the sum, never raises one
record's influence), adds global-DP noise N(0, sigma_G^2) once to that average, and takes one
optimiser step on the global prompt (DP-FPL's Algorithm 1, lines 16-18).

Trust model, as in the paper: the server is honest and sees each client's un-noised
global-prompt gradient. A record's batch feeds both its client's local release and the global
one, so the epsilon reported for it is their composition (``privacy.planner``). The mechanism
itself, with the ledger's note on that trust, is the methods' registry entry's ``global_dp``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fedvlm.metrics import GDP_DENOMINATOR, GDP_SIGMA
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import Payload
from fedvlm.strategies.prompt import PromptStrategy
from fedvlm.strategies.records import ClientUpdate
from fedvlm.tensor_names import GLOBAL_CTX, GLOBAL_GRAD
from fedvlm.utils.rng import ServerStream, server_key

log = logging.getLogger(__name__)


class GlobalGradientStrategy(PromptStrategy):
    sum_weighted = False  # the gradients' plain sum, over the denominator (secure aggregation)

    def __init__(self, parts: RunParts):
        super().__init__(parts)
        self._server_opt: torch.optim.Optimizer | None = None  # built at the first step, on the global prompt

    def initial_arrays(self):
        return {GLOBAL_CTX: self.initial_context()}

    def train_payload(self, node, server_round, arrays):
        return Payload({GLOBAL_CTX: arrays[GLOBAL_CTX]}, {GLOBAL_GRAD: arrays[GLOBAL_CTX].shape})

    def evaluate_payload(self, node, server_round, arrays):
        return Payload({GLOBAL_CTX: arrays[GLOBAL_CTX]})

    # ---- aggregation ----------------------------------------------------------------------
    def denominator(self, server_round: int, updates: list[ClientUpdate]) -> int:
        """What the round's sum is divided by: this round's sample, and never fewer than the
        clients the noise was planned for."""
        n = max(self.plans[server_round].sampled, len(updates))
        return max(n, self.budget.global_denominator() or 0)

    def pre_noise_mean(self, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """The average the server noises: the bounded uploads (``reply_bounds``) over the denominator."""
        return np.sum([u.reply.arrays[GLOBAL_GRAD] for u in updates], axis=0) / self.denominator(server_round, updates)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, float]:
        grad = torch.from_numpy(self.pre_noise_mean(server_round, updates).astype(np.float32))
        metrics: dict[str, float] = {}
        key = server_key(self.cfg.seed, server_round, ServerStream.GLOBAL_NOISE)
        released = self.budget.release_global(grad, key, self.registry.noise_sources())
        if released is not None:  # the server's mechanism, with privacy on
            grad, sigma = released
            metrics = {GDP_SIGMA: sigma, GDP_DENOMINATOR: self.denominator(server_round, updates)}
        self._server_step(grad)
        return metrics

    def aggregate_sums(self, server_round, sums, weights, survivors, updates):
        """``aggregate`` under secure aggregation: the survivors' summed gradients, which already
        carry the global noise where privacy is on (each client added its share, ``privacy.distributed``),
        over the same denominator."""
        n = max(self.plans[server_round].sampled, len(survivors), self.budget.global_denominator() or 0)
        grad = torch.from_numpy(
            (sums[GLOBAL_GRAD] / n).reshape(self.global_arrays[GLOBAL_CTX].shape).astype(np.float32)
        )
        metrics: dict[str, float] = {}
        noise = self.budget.distributed_noise()
        if noise is not None:  # what the survivors' shares add up to, on the mean
            metrics = {GDP_SIGMA: noise.gamma * noise.client_sigma * len(survivors) ** 0.5 / n, GDP_DENOMINATOR: n}
        self._server_step(grad)
        return metrics

    def _optimizer(self) -> torch.optim.Optimizer:
        if self._server_opt is None:
            param = torch.nn.Parameter(torch.from_numpy(self.global_arrays[GLOBAL_CTX].copy()))
            lr = self.cfg.dpfpl.server_lr
            adam = self.cfg.dpfpl.server_optimizer == "adam"
            self._server_opt = torch.optim.Adam([param], lr=lr) if adam else torch.optim.SGD([param], lr=lr)
        return self._server_opt

    def state_dict(self) -> dict:
        """Adds the server optimiser's moments (its parameter is the global prompt)."""
        opt = self._server_opt.state_dict() if self._server_opt is not None else None
        return {**super().state_dict(), "server_optimizer": opt}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state["server_optimizer"] is not None:
            self._optimizer().load_state_dict(state["server_optimizer"])

    def _server_step(self, grad: torch.Tensor) -> None:
        opt = self._optimizer()
        param = opt.param_groups[0]["params"][0]  # the global prompt
        opt.zero_grad()
        param.grad = grad
        opt.step()
        self.global_arrays = {GLOBAL_CTX: param.detach().numpy().copy()}
