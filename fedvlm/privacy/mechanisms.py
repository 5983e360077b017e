"""The Gaussian mechanism's parts on tensors: per-sample gradients, clipping, noise generators.

Per-sample gradients of prompt parameters: the expensive part of a prompt-learning step is
the text tower, shared by every sample of a batch. A sample's loss depends on the prompt
only through the text features, so its gradient is the text tower's vector-Jacobian
product with that sample's gradient on the features: first all samples' feature gradients
(cheap, batched), then one VJP per sample through the text tower (retaining its graph).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence

import numpy as np
import torch

from fedvlm.utils.rng import generator_for, numpy_rng


def per_sample_grads(losses: torch.Tensor, leaves: Sequence[torch.Tensor], via: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-sample gradients [B, *leaf.shape] of ``losses`` [B] w.r.t. each leaf.

    ``via``: the tensors (text features) through which every leaf reaches the losses.
    """
    batch = losses.shape[0]
    eye = torch.eye(batch, device=losses.device, dtype=losses.dtype)
    # d loss_i / d via, for all i at once (a small graph: logits only)
    cotangents = torch.autograd.grad(losses, list(via), grad_outputs=eye, is_grads_batched=True, retain_graph=True)
    out: list[list[torch.Tensor]] = [[] for _ in leaves]
    if losses.device.type == "cuda":
        # one batched VJP through the text tower (vmap over the cotangents)
        grads = torch.autograd.grad(list(via), list(leaves), grad_outputs=list(cotangents),
                                    is_grads_batched=True, retain_graph=True, allow_unused=True)
        return [g if g is not None else torch.zeros(batch, *leaf.shape, device=leaf.device) for g, leaf in zip(grads, leaves)]
    # On CPU a loop of plain VJPs over the retained graph is faster than vmap.
    for i in range(batch):
        grads = torch.autograd.grad(list(via), list(leaves), grad_outputs=[c[i] for c in cotangents],
                                    retain_graph=True, allow_unused=True)
        for j, (g, leaf) in enumerate(zip(grads, leaves)):
            out[j].append(g if g is not None else torch.zeros_like(leaf))
    return [torch.stack(o) for o in out]


def clip_per_sample(grads: torch.Tensor, clip: float) -> tuple[torch.Tensor, float]:
    """Scale each sample's gradient to L2 norm <= ``clip``; returns (clipped [B, ...], fraction clipped)."""
    flat = grads.reshape(grads.shape[0], -1)
    norms = flat.norm(dim=1)
    factors = (clip / (norms + 1e-12)).clamp(max=1.0)
    clipped = grads * factors.view(-1, *([1] * (grads.dim() - 1)))
    return clipped, float((norms > clip).float().mean())


def clip_tensor(g: torch.Tensor, clip: float) -> tuple[torch.Tensor, bool]:
    """Scale a whole tensor to L2 norm <= ``clip``."""
    norm = float(g.norm())
    return (g * (clip / norm), True) if norm > clip else (g, False)


# Where the randomness of a DP mechanism (its noise, and the batch sampling its amplification
# relies on) comes from:
# - "seeded": derived from the run's seed, so a run can be repeated exactly. Anyone who knows the
#   run config can regenerate it, so it protects nothing against the server or other clients:
#   for simulations and demos only.
# - "os": fresh entropy from the operating system, unknown to everyone else: what a real
#   organisation's data needs.
NOISE_SOURCES = ("seeded", "os")


def node_noise_source(node_config: dict, own_data: bool, run_choice: str = "auto") -> str:
    """A node's noise source. The organisation decides (node config ``noise-source``); without a
    choice, a node with its own data directory draws from the OS, a node on a partition of a
    shared dataset (simulation, demos) is seeded. The run config can only make it stronger
    (``privacy.noise-source = os``), never weaken what a node chose."""
    chosen = str(node_config.get("noise-source", "") or "")
    if chosen and chosen not in NOISE_SOURCES:
        raise ValueError(f"node config noise-source={chosen!r} is not one of {', '.join(NOISE_SOURCES)}")
    source = chosen or ("os" if own_data else "seeded")
    return "os" if run_choice == "os" else source


class OsNoise:
    """Gaussian noise from the operating system's cryptographically secure generator
    (``os.urandom``): Box-Muller on 53-bit uniforms. No seed exists that anyone could recover
    or regenerate, unlike a seeded Mersenne Twister (whose whole stream follows from 64 bits)."""

    def normal(self, shape: Sequence[int]) -> torch.Tensor:
        numel = int(np.prod(shape, dtype=np.int64))
        pairs = (numel + 1) // 2
        raw = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
        u = ((raw >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53  # uniform on (0, 1]
        radius = np.sqrt(-2.0 * np.log(u[0]))
        angle = 2.0 * np.pi * u[1]
        z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:numel]
        return torch.from_numpy(z.astype(np.float32)).reshape(tuple(shape))


def noise_generator(source: str, key: list[int] | None = None) -> torch.Generator | OsNoise:
    """The generator of one mechanism's draws: seeded from ``key`` (``utils.rng``;
    reproducible), or the OS's secure generator."""
    if source == "os":
        return OsNoise()
    if key is None:
        raise ValueError("a seeded noise generator needs its key (utils.rng.server_key / node_key)")
    return generator_for(key)


def sampling_rng(source: str, key: list[int]) -> np.random.Generator:
    """The generator of a client's batch sampling (Poisson subsampling must stay secret too).
    From the OS: 256 bits of seed material from the secure generator (``secrets``)."""
    if source == "os":
        return np.random.default_rng(np.random.SeedSequence(secrets.randbits(256)))
    return numpy_rng(key)



def gaussian_noise(shape: Sequence[int], std: float, generator: torch.Generator | OsNoise, device=None) -> torch.Tensor:
    """N(0, std^2) noise drawn on the CPU from ``generator`` (reproducible on any device when
    seeded)."""
    unit = generator.normal(shape) if isinstance(generator, OsNoise) else torch.randn(tuple(shape), generator=generator)
    return (unit * std).to(device or "cpu")
