"""Server strategies of the prompt-learning family.

All start from one initial context built on the server from the run's seed (random
N(0, init-std^2) or a phrase), so every method and every client starts from the same point.
"""

from __future__ import annotations

import numpy as np
import torch

from fedvlm.models.clip_loader import load_clip
from fedvlm.models.prompt_learner import TextTower, init_context
from fedvlm.strategies.aggregation import weighted_average
from fedvlm.strategies.base import FederatedStrategy
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import Payload
from fedvlm.strategies.records import ClientUpdate
from fedvlm.tensor_names import CTX


class PromptStrategy(FederatedStrategy):
    """Loads the backbone on the server (CPU) once, for the initial context and the
    fingerprint every client must match."""

    def __init__(self, parts: RunParts):
        cfg = parts.cfg
        self.bundle = load_clip(cfg.clip.model, cfg.clip.pretrained, cfg.cache_path, "cpu")
        super().__init__(parts)
        self.registry.server_fingerprint = self.bundle.fingerprint

    def backbone(self) -> dict | None:
        """Also the CLIP's name and where its weights came from (``clip.model``, ``clip.pretrained``):
        one name can stand for several sets of weights, which only the fingerprint tells apart."""
        b = self.bundle
        return {"name": b.name, "pretrained": b.pretrained, "fingerprint": b.fingerprint}

    def initial_context(self) -> np.ndarray:
        c = self.cfg
        n_classes = self.num_classes() if c.prompt.class_specific else 0
        gen = torch.Generator().manual_seed(c.seed)
        ctx = init_context(
            TextTower.from_open_clip(self.bundle.model),
            self.bundle.tokenizer,
            c.prompt.n_ctx,
            phrase=c.prompt.ctx_init,
            n_classes=n_classes,
            std=c.prompt.init_std,
            generator=gen,
        )
        return ctx.numpy().astype(np.float32)

    def initial_arrays(self) -> dict[str, np.ndarray]:
        return {CTX: self.initial_context()}


class PromptFLStrategy(PromptStrategy):
    """FedAvg of the prompt, weighted by each client's number of training examples.

    With DP each client runs DP-SGD on the prompt (per-sample clipping, Gaussian noise on
    every step's gradient), so the prompt it shares is already protected: noise added on the
    client before sharing, as DP-FPL's PromptFL baseline."""

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, float]:
        self.global_arrays = weighted_average(
            [u.reply.arrays for u in updates], [u.reply.num_examples for u in updates]
        )
        return {}


class LocalOnlyStrategy(PromptStrategy):
    """Local CoOp: clients keep their prompts. The server hands a node the public initial
    prompt until the node has answered once (so a node whose first reply failed still gets
    it); replies carry metrics only."""

    def __init__(self, parts: RunParts):
        super().__init__(parts)
        self.initialised: set[str] = set()

    def on_reply_accepted(self, node, phase):
        self.initialised.add(node.name)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "initialised": sorted(self.initialised)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.initialised = set(state["initialised"])

    def train_payload(self, node, server_round, arrays):
        return Payload({} if node.name in self.initialised else dict(arrays))

    def evaluate_payload(self, node, server_round, arrays):
        return self.train_payload(node, server_round, arrays)


class EvaluateOnlyStrategy(PromptStrategy):
    """Zero-shot: one evaluation round, nothing sent either way but metrics."""

    def initial_arrays(self):
        return {}

    def num_rounds(self) -> int:
        return 1

    def evaluate_payload(self, node, server_round, arrays):
        return Payload({})
