"""DP-SGD, once for every method: per-sample gradients, clipping, noise, and a node's accountant.

A private local step of any method (``client_app.trainer`` runs it):

1. per-sample gradients of the tensors that train, g_i for each record i of the batch;
2. each record's gradient clipped to C, per *clip group* (a group's tensors are clipped together:
   the whole adapter or network is one group; a prompt method clips each prompt tensor alone, so
   its local mechanism has sensitivity sqrt(groups) * C / B, ``privacy.planner.local_plan``);
3. the clipped gradients summed and divided by the *expected* batch size B (a Poisson batch's
   real size is itself private), then N(0, sigma^2) added to every noised tensor.

Per-batch clipping (the public DP-FPL code's behaviour) clips the batch gradient as a whole; the
ledger says the stated epsilon does not hold for it.

Every private step checks itself before anything is released (``MechanismError``, and the node
refuses the round): every clipped gradient it summed has norm <= C, and the noise it added has
the planned std (a chi-square test over the step's noised coordinates, two-sided at 1e-12). For
a correct mechanism both hold whatever the data (the first always, the second but for a 1e-12
chance), so a refusal tells nothing about the records. They catch what the one-run audit cannot
see: a mechanism that stopped clipping (the audit's canaries have norm C by construction) or
that draws less noise than planned.

Per-sample gradients, exactly, three ways (``backend_for``):

- ``functional`` (prompt tensors): a record's loss depends on a prompt only through the text
  features, so its gradient is a vector-Jacobian product of the text tower with that record's
  cotangent; the B products run batched (``torch.autograd.grad(..., is_grads_batched=True)``,
  i.e. vmap), in chunks of ``per_sample_chunk(device)`` records. Measured on this 2-core CPU
  (``bench/prompt_step.py``): all B at once is up to 1.6x slower than one at a time with 40
  class prompts (the batched backward's activations outgrow the cache), chunks of 4 are as
  fast as one at a time; an accelerator takes them all at once;
- ``hooks`` (``nn.Module``s whose trainable layers Opacus can hook, e.g. peft LoRA's ``Linear``
  layers, reprogramming's program and output map): Opacus' ``GradSampleModule`` (its own rule
  per layer type, or vmap over the layer's forward for a custom layer);
  ``expanded``: Opacus' ExpandedWeights mode, for networks whose in-place residual additions
  backward hooks cannot follow (a model says so with ``per_sample_backend = "expanded"``);
- ``microbatch``: one backward per record, model-agnostic, for trainable layers Opacus has no
  rule for (peft LoHa keeps its factors in ``ParameterDict``s, which are never called).

``NodeAccountant`` is a node's own account of what its DP-SGD steps spent: Opacus' RDP and PRV
accountants over the releases in the node's ledger (``client_app.privacy_floor``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from fedvlm.privacy.accounting import MEANINGLESS_EPSILON
from fedvlm.privacy.mechanisms import OsNoise, gaussian_noise
from fedvlm.privacy.noise_check import MechanismError, check_noise

if TYPE_CHECKING:
    from opacus.grad_sample.gsm_base import AbstractGradSampleModule

BACKENDS = ("functional", "hooks", "expanded", "microbatch")


@dataclass(frozen=True)
class DPStep:
    """One private step's mechanism, as the round's plan fixes it."""

    clip: float
    expected_batch: int  # B: the divisor of the clipped sum (the Poisson batch's expected size)
    sigma: float  # std of the noise on every noised tensor's result
    groups: tuple[tuple[str, ...], ...]  # tensors clipped together to C (every trained tensor in one)
    noised: frozenset[str]  # tensors that get the noise (others, e.g. a global prompt, are noised elsewhere)
    per_batch: bool = False  # clip the batch gradient as a whole (no per-record guarantee)


CLIP_SLACK = 1e-3  # float rounding of a clip to C


def check_clipped(rows: torch.Tensor, clip: float, what: str) -> None:
    """Every row (a record's gradient, or a batch's) has L2 norm <= ``clip``."""
    worst = float(rows.reshape(rows.shape[0], -1).norm(dim=1).max()) if rows.shape[0] else 0.0
    if not worst <= clip * (1 + CLIP_SLACK):  # the text names the bound, never the norm (a value of the data)
        raise MechanismError(
            f"a {what} entering the private sum is above the clip norm {clip:g}: the mechanism did not clip; "
            "refusing to release this round"
        )


def per_sample_clip(grads: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each record's gradient [B, ...] to L2 norm <= ``clip``; returns (clipped, clipped?[B])."""
    norms = grads.reshape(grads.shape[0], -1).norm(dim=1)
    factors = (clip / (norms + 1e-12)).clamp(max=1.0)
    return grads * factors.view(-1, *([1] * (grads.dim() - 1))), norms > clip


def privatize(
    per_sample: Mapping[str, torch.Tensor],
    step: DPStep,
    noise: torch.Generator | OsNoise,
    shapes: Mapping[str, torch.Size],
) -> tuple[dict[str, torch.Tensor], float]:
    """Clip each record's gradient per group, sum, divide by B, add the noise. ``per_sample``
    maps every tensor of ``step.groups`` to its [b, ...] per-sample gradients (b may be 0: an
    empty Poisson batch releases the noise alone). Returns (gradients, fraction of records
    clipped, over groups)."""
    out: dict[str, torch.Tensor] = {}
    fractions = []
    for group in step.groups:
        if per_sample[group[0]].shape[0] == 0:
            out.update({k: torch.zeros(shapes[k], device=per_sample[k].device) for k in group})
            continue
        flat = [per_sample[k].reshape(per_sample[k].shape[0], -1) for k in group]
        joined = flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)
        clipped, was = per_sample_clip(joined, step.clip)
        check_clipped(clipped, step.clip, "record's gradient")
        summed = clipped.sum(0) / step.expected_batch
        fractions.append(float(was.float().mean()))
        offset = 0
        for k in group:
            n = int(np.prod(shapes[k], dtype=np.int64))
            out[k] = summed[offset : offset + n].view(shapes[k])
            offset += n
    return _add_noise(out, step, noise), (float(np.mean(fractions)) if fractions else 0.0)


def privatize_batch(
    grads: Mapping[str, torch.Tensor], step: DPStep, noise: torch.Generator | OsNoise
) -> tuple[dict[str, torch.Tensor], float]:
    """Per-batch clipping: each group's batch gradient clipped to C as a whole, then noised."""
    out: dict[str, torch.Tensor] = {}
    clipped = []
    for group in step.groups:
        joined = torch.cat([grads[k].reshape(-1) for k in group])
        norm = float(joined.norm())
        scale = step.clip / norm if norm > step.clip else 1.0
        clipped.append(norm > step.clip)
        check_clipped((joined * scale)[None], step.clip, "batch gradient")
        out.update({k: grads[k] * scale if scale != 1.0 else grads[k] for k in group})
    return _add_noise(out, step, noise), float(np.mean(clipped)) if clipped else 0.0


def _add_noise(grads: dict[str, torch.Tensor], step: DPStep, noise) -> dict[str, torch.Tensor]:
    if step.sigma > 0:
        added = {}
        for k in grads:  # in the groups' order, so a seeded run draws the same noise every time
            if k in step.noised:
                clean = grads[k]
                grads[k] = clean + gaussian_noise(clean.shape, step.sigma, noise, clean.device)
                added[k] = grads[k] - clean
        check_noise(added, step.sigma)
    return {k: v.detach() for k, v in grads.items()}


# ---- per-sample gradients -------------------------------------------------------------------
CPU_CHUNK = 4  # records per batched VJP on a CPU (see the module docstring)


def per_sample_chunk(device: torch.device, batch: int) -> int:
    return CPU_CHUNK if device.type == "cpu" else batch


def functional_per_sample(
    losses: torch.Tensor,
    leaves: Mapping[str, torch.Tensor],
    via: Sequence[torch.Tensor],
    chunk: int | None = None,
    direct: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """Per-sample gradients [B, *leaf.shape] of ``losses`` [B] w.r.t. each leaf, where every leaf
    reaches the losses only through the tensors ``via`` (the text features): the cotangents of
    all records first (a small graph: logits only), then batched VJPs through the text tower,
    ``chunk`` records at a time (default ``per_sample_chunk``). The leaves named in ``direct``
    act on each record separately after ``via`` (pFedMoAP's gate): their per-sample gradients
    come out of the first, batched pass."""
    batch = losses.shape[0]
    names = [k for k in leaves if k not in direct]
    chunk = chunk or per_sample_chunk(losses.device, batch)
    eye = torch.eye(batch, device=losses.device, dtype=losses.dtype)
    first = torch.autograd.grad(
        losses,
        [*via, *(leaves[k] for k in direct)],
        grad_outputs=eye,
        is_grads_batched=True,
        retain_graph=True,
        allow_unused=True,
    )
    cotangents = first[: len(via)]
    out = {
        k: g if g is not None else torch.zeros(batch, *leaves[k].shape, device=leaves[k].device)
        for k, g in zip(direct, first[len(via) :], strict=True)
    }
    if not names:
        return out
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for start in range(0, batch, chunk):
        grads = torch.autograd.grad(
            list(via),
            [leaves[k] for k in names],
            grad_outputs=[c[start : start + chunk] for c in cotangents],
            is_grads_batched=True,
            retain_graph=True,
            allow_unused=True,
        )
        for k, g in zip(names, grads, strict=True):
            n = min(chunk, batch - start)
            parts[k].append(g if g is not None else torch.zeros(n, *leaves[k].shape, device=leaves[k].device))
    return {**out, **{k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}}


def backend_for(module: nn.Module) -> str:
    """How to take ``module``'s per-sample gradients (see the module docstring)."""
    declared = getattr(module, "per_sample_backend", "")
    if declared:
        if declared not in BACKENDS:
            raise ValueError(f"{type(module).__name__}.per_sample_backend = {declared!r} is not one of {BACKENDS}")
        return declared
    # Opacus hooks every module that holds trainable parameters itself: by its own rule (Linear,
    # Conv, LayerNorm, ...) or by vmap over that module's forward (e.g. reprogramming's input
    # program). A parameter container (ParameterDict/List) is never called, so nothing fires.
    for m in module.modules():
        if isinstance(m, (nn.ParameterDict, nn.ParameterList)) and any(p.requires_grad for p in m.parameters()):
            return "microbatch"
    return "hooks"


class ModuleGradients:
    """Per-sample gradients of an ``nn.Module``'s trainable parameters while it is attached.

    Use: ``attach()`` once before the round's steps (it returns the callable to run the forward
    through: the module itself for hooks, a wrapper for ExpandedWeights), ``per_sample`` after
    each step's forward, ``detach()`` after the round (the module is left as it was)."""

    def __init__(self, module: nn.Module, backend: str | None = None):
        self.module = module
        self.backend = backend or backend_for(module)
        self.params = {k: p for k, p in module.named_parameters() if p.requires_grad}
        self._wrapped: AbstractGradSampleModule | None = None

    def attach(self) -> nn.Module:
        from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights

        if self.backend == "hooks":
            # loss "sum": the per-sample losses are summed, so each grad_sample is one record's gradient
            self._wrapped = GradSampleModule(self.module, batch_first=True, loss_reduction="sum", strict=False)
            return self.module
        if self.backend == "expanded":
            self._wrapped = GradSampleModuleExpandedWeights(self.module, batch_first=True, loss_reduction="sum")
            return self._wrapped
        return self.module

    def detach(self) -> None:
        if self.backend == "hooks" and self._wrapped is not None:
            self._wrapped.cleanup()  # removes the hooks and Opacus' attributes on the parameters
        for p in self.params.values():
            p.grad = None
            if hasattr(p, "grad_sample"):
                del p.grad_sample
        self._wrapped = None

    def per_sample(
        self,
        leaves: Mapping[str, torch.Tensor],
        losses: Callable[[np.ndarray], torch.Tensor],
        batch: np.ndarray,
        forward_losses: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """[b, *shape] per leaf (the module's trainable parameters, by the learner's names).
        ``forward_losses``: the batch's per-sample losses from the step's forward (hooks,
        expanded); the microbatch backend recomputes each record's loss with ``losses(indices)``."""
        if self.backend == "microbatch":
            per: dict[str, list[torch.Tensor]] = {k: [] for k in leaves}
            for i in batch:
                g = torch.autograd.grad(losses(np.asarray([i])).sum(), list(leaves.values()), allow_unused=True)
                for (k, p), gi in zip(leaves.items(), g, strict=True):
                    per[k].append(gi if gi is not None else torch.zeros_like(p))
            return {k: torch.stack(v) for k, v in per.items()}
        for p in leaves.values():
            p.grad = None
            p.grad_sample = None  # type: ignore[attr-defined]  # Opacus' attribute on parameters
        with warnings.catch_warnings():
            # an input that needs no gradient (the images) makes torch warn at every backward
            # through a full backward hook; the per-sample gradients are unaffected
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            forward_losses.sum().backward()
        out = {}
        for k, p in leaves.items():
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                if p.grad is not None:  # reached, but no per-sample rule ran: never guess
                    raise RuntimeError(
                        f"no per-sample gradient was computed for {k}: its layer is not one Opacus "
                        "hooks can follow; give the model per_sample_backend = 'microbatch'"
                    )
                gs = torch.zeros((len(batch), *p.shape), device=p.device, dtype=p.dtype)  # not reached
            out[k] = gs.detach()
            p.grad_sample = None  # type: ignore[attr-defined]  # Opacus' attribute on parameters
            p.grad = None
        return out


# ---- a node's own accountant ------------------------------------------------------------------
class NodeAccountant:
    """What this node's DP-SGD steps have spent, by Opacus' RDP and PRV accountants, from the
    releases in the node's ledger (``client_app.privacy_floor``: (noise multiplier, sampling rate,
    steps) per round) and those ``step`` adds."""

    def __init__(self, releases: list[tuple[float, float, int]] | None = None):
        from opacus.accountants import RDPAccountant

        self.rdp = RDPAccountant()
        for z, rate, steps in releases or []:
            self.step(z, rate, steps)

    def step(self, noise_multiplier: float, sample_rate: float, steps: int) -> None:
        for _ in range(steps):
            self.rdp.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def epsilon(self, delta: float) -> dict[str, float]:
        """RDP and PRV epsilon at ``delta``. The PRV accountant discretises a domain that grows
        with epsilon: past ``MEANINGLESS_EPSILON`` (no privacy to speak of) the valid, looser RDP
        bound stands in for it instead of exhausting memory."""
        from opacus.accountants import PRVAccountant

        if not self.rdp.history:
            return {"rdp": 0.0, "prv": 0.0}
        out = {"rdp": float(self.rdp.get_epsilon(delta))}
        if out["rdp"] <= MEANINGLESS_EPSILON:
            prv = PRVAccountant()
            prv.load_state_dict({"history": list(self.rdp.history), "mechanism": prv.mechanism()})
            out["prv"] = float(prv.get_epsilon(delta))
        else:
            out["prv"] = out["rdp"]
        return out
