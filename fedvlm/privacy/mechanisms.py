"""The Gaussian mechanism's parts on tensors: clipping a whole tensor, and where the noise
(and the secret batch sampling) comes from. DP-SGD itself is ``privacy.dpsgd``."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence

import numpy as np
import torch

from fedvlm.utils.rng import generator_for, numpy_rng


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
NOISE_SOURCE = "noise-source"  # the node config key


def node_noise_source(
    node_config: dict,
    *,
    own_data: bool,
    simulated: bool,
    states_limit: bool,
    run_choice: str = "auto",
    private: bool = True,
) -> str:
    """A node's noise source. The organisation decides (node config ``noise-source``); without a
    choice a node draws from the OS unless it is simulated (``utils.runtime``) on a partition of
    a shared dataset and states no privacy limit of its own: a real node, a node with its own data
    directory and a node with ``max-epsilon`` never get regenerable noise by default, whatever the
    run config says. The run config can only make it stronger (``privacy.noise-source = os``),
    never weaken what a node chose or defaults to. A node that states a limit and asks for seeded
    noise is refused by its own floor (``client_app.privacy_floor``). A run without privacy
    (``private`` false) draws no noise, and its batches need no secret: seeded, as in simulation."""
    chosen = str(node_config.get(NOISE_SOURCE, "") or "")
    if chosen and chosen not in NOISE_SOURCES:
        raise ValueError(f"node config noise-source={chosen!r} is not one of {', '.join(NOISE_SOURCES)}")
    if run_choice == "os" or (states_limit and not chosen):
        return "os"
    if chosen:
        return chosen
    if not private:
        return "seeded"
    return "seeded" if simulated and not own_data else "os"


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
