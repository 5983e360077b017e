"""Server side of the global/local prompt methods (DP-FPL, FedOTP, FedPGP).

Each round the sampled clients return the clipped gradient of the global prompt. The server
averages them over the number of clients it SAMPLED (a fixed denominator: a dropped reply
lowers the sum, never raises one record's influence), adds global-DP noise N(0, sigma_G^2)
once to that average, and takes one optimiser step on the global prompt (DP-FPL's
Algorithm 1, lines 16-18). It also plans every client's local-DP noise (sent with each
train message) and keeps the privacy ledger.

Trust model, as in the paper: the server is honest and sees each client's un-noised
global-prompt gradient; the global-DP guarantee covers the global prompt it publishes.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from privacy.ledger import plan_gaussian
from privacy.mechanisms import gaussian_noise, noise_generator
from strategies.base import ClientUpdate
from strategies.prompt import PromptStrategy

log = logging.getLogger(__name__)

NOISE_STREAM_GLOBAL = 21


class GlobalGradientStrategy(PromptStrategy):
    local_dp = ("ldp-lowrank", "client: gradients of the local low-rank factors u and v at every local step", 2)

    def __init__(self, cfg, spec):
        super().__init__(cfg, spec)
        if cfg["prompt.class-specific"]:
            raise ValueError(f"method {spec.name!r} needs a shared context (prompt.class-specific=false)")
        rank = cfg["dpfpl.rank"]
        if spec.name == "fedpgp" and rank == 0:
            raise ValueError("fedpgp needs a low rank (dpfpl.rank >= 1): its personal part is u v")
        if spec.name == "fedotp":
            self.local_dp = ("ldp-local", "client: gradient of the full-rank local prompt at every local step", 1)
        if spec.name == "dpfpl":
            self.local_dp = ("ldp-lowrank" if rank else "ldp-local",
                             "client: gradients of u and v (the local prompt's rank-k factors) at every local step"
                             if rank else "client: gradient of the full-rank local prompt at every local step",
                             2 if rank else 1)
        self._server_opt = None
        self._global_param = None

    def initial_arrays(self):
        ctx = self.initial_context()
        if self.spec.name in ("dpfpl", "fedpgp") and self.cfg["dpfpl.rank"] > ctx.shape[0]:
            raise ValueError(f"dpfpl.rank = {self.cfg['dpfpl.rank']} exceeds the {ctx.shape[0]} context tokens; "
                             f"use a rank of at most {ctx.shape[0]} (or 0 for full rank)")
        return {"global_ctx": ctx}

    def reply_shapes(self, node, server_round):
        return {"global_grad": self.global_arrays["global_ctx"].shape}

    def train_payload(self, node, server_round):
        return {"global_ctx": self.global_arrays["global_ctx"]}

    def evaluate_payload(self, node, server_round):
        return {"global_ctx": self.global_arrays["global_ctx"]}

    def train_config(self, node, server_round):
        return {"noise.local": self.client_plan(node).sigma} if self.privacy.enabled else {}

    # ---- privacy plan ---------------------------------------------------------------------
    def plan_privacy(self) -> None:
        super().plan_privacy()
        n_round = self.nodes_per_round()
        b = min(self.cfg["prompt.batch-size"], min(n.num_train for n in self.nodes.values()))
        steps = [self.local_steps(n) for n in self.nodes.values()]
        # Record-level: one record moves its client's clipped mean by <= C/B, the average of the
        # round's clients by <= C/(N*B). Subsampling amplification is claimed only when a round
        # is one Poisson-sampled step (local-steps = 1); the largest rate over clients is used.
        q = max(min(self.cfg["prompt.batch-size"], n.num_train) / n.num_train for n in self.nodes.values())
        plan = plan_gaussian(
            self.privacy, "gdp-global",
            f"server: average of the {n_round} sampled clients' clipped global-prompt gradients, once per round",
            "server", sensitivity=self.privacy.clip / (n_round * b), releases=self.num_rounds(),
            sampling_rate=q if max(steps) == 1 else 1.0,
            per_batch_sensitivity=2 * self.privacy.clip / n_round,
        )
        if max(steps) > 1:
            plan.notes.append("several local steps per round: no subsampling amplification is claimed")
        self.ledger.add_plan(plan)
        self.ledger.notes.append("trusted server (as in DP-FPL): it sees each client's un-noised global-prompt "
                                 "gradient; global DP protects the published global prompt")

    # ---- aggregation ----------------------------------------------------------------------
    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> None:
        sampled = max(self._round.get("sampled", len(updates)), len(updates))
        mean = np.sum([u.arrays["global_grad"] for u in updates], axis=0) / sampled
        grad = torch.from_numpy(mean.astype(np.float32))
        if self.privacy.enabled:
            sigma = self.ledger.plans["gdp-global"].sigma
            gen = noise_generator(self.server_noise_source(), self.cfg["seed"], server_round, NOISE_STREAM_GLOBAL)
            grad = grad + gaussian_noise(grad.shape, sigma, gen)
            self.global_releases["gdp-global"] = self.global_releases.get("gdp-global", 0) + 1
            self._round.setdefault("metrics", {})["gdp-sigma"] = sigma
        self._server_step(grad)

    def _server_step(self, grad: torch.Tensor) -> None:
        if self._global_param is None:
            self._global_param = torch.nn.Parameter(torch.from_numpy(self.global_arrays["global_ctx"].copy()))
            lr = self.cfg["dpfpl.server-lr"]
            self._server_opt = (torch.optim.Adam([self._global_param], lr=lr) if self.cfg["dpfpl.server-optimizer"] == "adam"
                                else torch.optim.SGD([self._global_param], lr=lr))
        self._server_opt.zero_grad()
        self._global_param.grad = grad
        self._server_opt.step()
        self.global_arrays = {"global_ctx": self._global_param.detach().numpy().copy()}
