"""Server side of the global/local prompt methods (DP-FPL, FedOTP, FedPGP).

Each round the sampled clients return the clipped gradient of the global prompt. The server
averages them over a fixed denominator: the number of clients sampled at planning, or this
round's sample if larger (a dropped reply or a lost node lowers the sum, never raises one
record's influence), and takes one optimiser step on the global prompt (DP-FPL's Algorithm 1,
lines 16-18). With privacy on, the global-DP noise N(0, sigma_G^2) is added once to that
average by a layer around this strategy (``strategies.global_noise``), between ``mean`` and
``step``.

Trust model, as in the paper: the server is honest and sees each client's un-noised
global-prompt gradient. A record's batch feeds both its client's local release and the global
one, so the epsilon reported for it is their composition (``privacy.planner``). The mechanism
itself, with the ledger's note on that trust, is the methods' registry entry's ``global_dp``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import Payload
from fedvlm.strategies.prompt import PromptStrategy
from fedvlm.strategies.records import ClientUpdate, RoundSum
from fedvlm.tensor_names import GLOBAL_CTX, GLOBAL_GRAD

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
    def denominator(self, server_round: int, count: int) -> int:
        """What the round's sum of ``count`` gradients is divided by: this round's sample, and
        never fewer than the clients the run's global noise was planned for."""
        n = max(self.plans[server_round].sampled, count)
        return max(n, self.budget.global_denominator() or 0)

    def mean(self, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """The uploads' average over the denominator: what a global mechanism noises
        (``strategies.global_noise``) before ``step`` takes it."""
        return np.sum([u.reply.arrays[GLOBAL_GRAD] for u in updates], axis=0) / self.denominator(
            server_round, len(updates)
        )

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, float]:
        self.step(torch.from_numpy(self.mean(server_round, updates).astype(np.float32)))
        return {}

    def aggregate_sums(self, server_round: int, total: RoundSum, updates: list[ClientUpdate]) -> dict[str, float]:
        """``aggregate`` from the survivors' summed gradients (secure aggregation), over the same
        denominator."""
        n = self.denominator(server_round, len(total.survivors))
        grad = (total.sums[GLOBAL_GRAD] / n).reshape(self.global_arrays[GLOBAL_CTX].shape)
        self.step(torch.from_numpy(grad.astype(np.float32)))
        return {}

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

    def step(self, grad: torch.Tensor) -> None:
        """One server optimiser step on the global prompt along ``grad``."""
        opt = self._optimizer()
        param = opt.param_groups[0]["params"][0]  # the global prompt
        opt.zero_grad()
        param.grad = grad
        opt.step()
        self.global_arrays = {GLOBAL_CTX: param.detach().numpy().copy()}
