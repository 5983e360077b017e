"""The one local-training loop every method runs: batches -> the method's loss -> one (private)
gradient step -> the method's update -> metrics.

A method's client implements the ``Learner`` hooks; ``local_round`` does the rest:

    for each of the plan's steps:
        batch   = the step's record indices (``batches``)
        leaves  = learner.begin_step()         # the tensors this step differentiates
        out     = learner.forward(batch)       # per-record losses (+ what the backend needs)
        grads   = gradients of out, private when privacy is on (``privacy.dpsgd``)
        grads  += learner.extra_gradients()    # data-independent terms (FedProx, FedPGP's contrast)
        learner.apply(grads)                   # the optimiser step (or a method's own update)

Batches:
- without DP: a fresh permutation per epoch (a partial tail joins the next epoch);
- DP, accountant calibration: Poisson sampling, each record independently with rate q = B/n,
  which is what the accountant's subsampling amplification assumes;
- DP, paper calibration: a uniformly drawn batch of exactly B records per step (the paper's
  code), for which no amplification is claimed.

The plan (steps, batch size) comes from the server's train message (``protocol``) after the
client checked it (``privacy.planner.client_plan``); nothing here recomputes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedvlm.metrics import (
    CLIPPED_FRACTION,
    NUM_EXAMPLES,
    STEPS,
    TRAIN_ACC,
    TRAIN_LOSS,
    TRAIN_LOSS_FIRST,
    TRAIN_LOSS_LAST,
)
from fedvlm.privacy.canaries import Canaries
from fedvlm.privacy.dpsgd import DPStep, ModuleGradients, functional_per_sample, privatize, privatize_batch
from fedvlm.privacy.mechanisms import OsNoise
from fedvlm.privacy.planner import ClientShape
from fedvlm.runconfig.schema import PrivacyConfig


def batches(
    n: int, batch_size: int, steps: int, settings: PrivacyConfig, rng: np.random.Generator
) -> Iterator[np.ndarray]:
    """Indices of the batch of each local step (see the module docstring)."""
    bsz = min(batch_size, n)
    if settings.enabled and settings.sampling == "poisson":
        q = batch_size / n if n > batch_size else 1.0
        for _ in range(steps):
            yield np.flatnonzero(rng.random(n) < q)
        return
    if settings.enabled:
        for _ in range(steps):
            yield rng.choice(n, size=bsz, replace=False)
        return
    order = np.empty(0, dtype=np.int64)
    for _ in range(steps):
        if len(order) < bsz:
            order = np.concatenate([order, rng.permutation(n)])
        batch, order = order[:bsz], order[bsz:]
        yield batch


@dataclass
class StepOutput:
    """What a method's forward returns for one batch."""

    losses: torch.Tensor  # [b] per-record losses (b may be 0: an empty Poisson batch)
    via: Sequence[torch.Tensor] = ()  # prompt methods: the tensors every leaf reaches the losses through
    direct: Sequence[str] = ()  # ... except these leaves, applied to each record after ``via`` (a gate)
    objective: torch.Tensor | None = None  # the non-private objective, where it is not losses.mean()
    correct: int | None = None  # records classified right (classification methods)


class Learner:
    """The hooks of one method's local training, implemented by a round's session: the object a
    client builds for one round (``Client.begin_round``) that holds what the round trains (the
    leaves, the optimiser, the data) and lives only as long as the round."""

    # nn.Module-based methods: the module whose trainable parameters are the leaves; per-sample
    # gradients then come from Opacus (``privacy.dpsgd.ModuleGradients``). None: prompt tensors
    # (the functional backend, through ``StepOutput.via``).
    module: nn.Module | None = None
    # what the forward calls: the module, or the wrapper the per-sample backend needs while attached
    net: nn.Module | None = None

    def begin_step(self) -> Mapping[str, torch.Tensor]:
        """The tensors this step differentiates (leaves requiring grad), by name."""
        raise NotImplementedError

    def forward(self, batch: np.ndarray) -> StepOutput:
        raise NotImplementedError

    def clip_groups(self, names: Sequence[str]) -> tuple[tuple[str, ...], ...]:
        """Tensors clipped together to C: default, each alone (the planner's sqrt(groups) * C / B)."""
        return tuple((k,) for k in names)

    def noised(self, names: Sequence[str]) -> frozenset[str]:
        """The tensors that get this node's local-DP noise (default: every one it trains)."""
        return frozenset(names)

    def extra_gradients(self) -> dict[str, torch.Tensor]:
        """Gradients of data-independent terms, added after clipping and noise: they reveal
        nothing about the records and cost no privacy."""
        return {}

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


@dataclass
class RoundStats:
    steps: int = 0
    losses: list[float] = field(default_factory=list)  # per non-empty step
    correct: int = 0
    seen: int = 0
    classified: bool = False
    clipped: list[float] = field(default_factory=list)  # per private step: fraction of records clipped
    backend: str = ""

    @property
    def loss(self) -> float:
        return float(np.mean(self.losses)) if self.losses else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.seen if self.seen else float("nan")

    def metrics(self, num_examples: int) -> dict[str, Any]:
        """The round's figures. A round whose batches were all empty (Poisson sampling at a small
        B) trained on no record: it reports no loss or accuracy rather than a NaN, and its noised
        update goes out as every other round's does (the server keeps a reply whatever its
        figures, ``strategies.validation``)."""
        out: dict[str, Any] = {NUM_EXAMPLES: num_examples, STEPS: self.steps}
        if self.losses:
            out |= {TRAIN_LOSS: self.loss, TRAIN_LOSS_FIRST: self.losses[0], TRAIN_LOSS_LAST: self.losses[-1]}
        if self.classified and self.seen:
            out[TRAIN_ACC] = self.accuracy
        if self.clipped:
            out[CLIPPED_FRACTION] = float(np.mean(self.clipped))
        return out


@dataclass
class _PrivateSteps:
    """What each DP-SGD step of a round needs besides its batch (``local_round``)."""

    learner: Learner
    shape: ClientShape
    privacy: PrivacyConfig
    sigma: float
    noise: torch.Generator | OsNoise
    canaries: Canaries | None
    module_grads: ModuleGradients | None

    def gradients(
        self, leaves: Mapping[str, torch.Tensor], batch: np.ndarray, sampled: np.ndarray, out, objective
    ) -> tuple[dict, float]:
        """The step's privatised gradients (clipped, noised) and the fraction of records clipped."""
        privacy, canaries, learner = self.privacy, self.canaries, self.learner
        step = DPStep(
            privacy.clip,
            self.shape.expected_batch,
            self.sigma,
            learner.clip_groups(list(leaves)),
            learner.noised(list(leaves)),
        )
        shapes = {k: v.shape for k, v in leaves.items()}
        if canaries is not None:
            canaries.place(shapes, step.groups, step.noised)
        if privacy.clipping == "per-sample":
            samples = self._per_sample(leaves, batch, out)
            if canaries is not None:
                samples = canaries.with_canaries(samples, sampled, shapes, privacy.clip)
            return privatize(samples, step, self.noise, shapes)
        batch_grads = (
            _gradients(objective, leaves) if len(batch) else {k: torch.zeros_like(v) for k, v in leaves.items()}
        )
        if canaries is not None:
            batch_grads = canaries.into_batch(batch_grads, len(batch), sampled, privacy.clip)
        return privatize_batch(batch_grads, step, self.noise)

    def _per_sample(self, leaves: Mapping[str, torch.Tensor], batch: np.ndarray, out) -> dict:
        if len(batch) == 0:
            return {k: torch.zeros((0, *v.shape), device=v.device) for k, v in leaves.items()}
        if self.module_grads is not None:
            forward = self.learner.forward
            return self.module_grads.per_sample(leaves, lambda idx: forward(idx).losses, batch, out.losses)
        return functional_per_sample(out.losses, leaves, out.via, direct=out.direct)


def local_round(
    learner: Learner,
    shape: ClientShape,
    privacy: PrivacyConfig,
    sigma: float,
    sampling: np.random.Generator,
    noise: torch.Generator | OsNoise,
    canaries: Canaries | None = None,
) -> RoundStats:
    """Run the plan's local steps (see the module docstring). ``sigma``: the std of this node's
    local-DP noise, already checked against its own plan (0 without privacy). With the audited
    node's ``canaries``, the slots past the node's real records are theirs: a present canary
    sampled into a step adds its gradient row, and the step's released gradients are scored
    (``privacy.canaries``)."""
    stats = RoundStats(steps=shape.steps)
    canaries = canaries if privacy.enabled else None
    n_real = shape.n_train - (canaries.m if canaries is not None else 0)
    no_canary = np.empty(0, dtype=np.int64)
    per_sample = privacy.enabled and privacy.clipping == "per-sample"
    module_grads = ModuleGradients(learner.module) if learner.module is not None and per_sample else None
    if learner.module is not None:
        learner.net = module_grads.attach() if module_grads else learner.module
    stats.backend = module_grads.backend if module_grads else ("functional" if per_sample else "")
    private = _PrivateSteps(learner, shape, privacy, sigma, noise, canaries, module_grads)
    try:
        for slots in batches(shape.n_train, shape.batch_size, shape.steps, privacy, sampling):
            batch, sampled = canaries.split(slots, n_real) if canaries is not None else (slots, no_canary)
            leaves = learner.begin_step()
            out = learner.forward(batch)
            # what the step minimises: the per-record mean under DP (each record's loss alone)
            objective = out.objective if out.objective is not None and not privacy.enabled else out.losses.mean()
            if not privacy.enabled:
                grads = _gradients(objective, leaves)
            else:
                grads, frac = private.gradients(leaves, batch, sampled, out, objective)
                stats.clipped.append(frac)
                if canaries is not None:
                    canaries.observe(grads)  # before any data-independent term: the mechanism's output
            for k, g in learner.extra_gradients().items():
                grads[k] = grads[k] + g.detach()
            learner.apply(grads)
            if len(batch):
                stats.losses.append(float(objective.detach()))
                if out.correct is not None:
                    stats.classified = True
                    stats.correct += out.correct
                    stats.seen += len(batch)
    finally:
        if module_grads is not None:
            module_grads.detach()
        if learner.module is not None:
            learner.net = learner.module
    return stats


def _gradients(objective: torch.Tensor, leaves: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ordinary gradient (the graph is kept: a method's extra term may go through it)."""
    names = list(leaves)
    g = torch.autograd.grad(objective, [leaves[k] for k in names], allow_unused=True, retain_graph=True)
    return {k: (gi if gi is not None else torch.zeros_like(leaves[k])).detach() for k, gi in zip(names, g, strict=True)}
