"""What a node adds to a secure round's sum, and how the server reads the sum back.

A node's vector is laid out by the server (``SumPlan``: the tensors' names and sizes, the same
for every node of the round): the node's update, tensor by tensor (zeros for a tensor it does
not send, e.g. the other half of FedRand's adapter), then one weight per tensor (its weight
where it sends the tensor, else 0). The weight is the node's example count for a weighted
average, 1 for a plain sum. The server divides each tensor's sum by its weight's sum: a
per-tensor weighted average, which is every summing method's aggregation (FedAvg, FedRand's
per-half average, a global gradient's sum over its fixed denominator with weights of 1).

The update is what the reply would have changed (returned minus sent; a returned gradient as it
is), so that its bound means the same as the server's reply bound (``strategies.validation``).
Encoding, with noise (``privacy.distributed``, global-DP methods): the update, whose norm the
method's clipping already bounds, is checked against that bound, scaled by 1/gamma, rounded
and noised. Without noise: the node clips its update to the round's bound itself (the server can
no longer check one update), multiplies it by its weight, scales and rounds it. Then modulo
2^bits. The server picks gamma so that the sum of every node's largest possible vector fits in
half the modulus (``plain_gamma``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedvlm.privacy.distributed import DistributedGaussian, Uniforms, stochastic_round
from fedvlm.secagg.masks import decode, encode
from fedvlm.secagg.stages import SumPlan


def plain_gamma(clients: int, max_weight: int, norm_bound: float, bits: int) -> float:
    """The quantisation step at which ``clients`` vectors of weight at most ``max_weight`` and
    norm at most ``norm_bound`` sum to at most a quarter of the modulus in every coordinate."""
    return clients * max_weight * norm_bound / 2.0 ** (bits - 2)


@dataclass(frozen=True)
class Summand:
    plan: SumPlan

    @property
    def dim(self) -> int:
        return int(sum(self.plan.sizes))

    @property
    def noise(self) -> DistributedGaussian | None:
        p = self.plan
        if p.client_sigma <= 0:
            return None
        return DistributedGaussian(p.gamma, p.client_sigma, p.n_min, self.dim, p.norm_bound, p.bits)

    def encode(self, update: Mapping[str, np.ndarray], weight: int, uniforms: Uniforms) -> np.ndarray:
        """The node's residues: its ``update`` (name -> array, a subset of the plan's names) with
        ``weight``, encoded as the module docstring says."""
        p = self.plan
        unknown = sorted(set(update) - set(p.names))
        if unknown:
            raise ValueError(f"the update holds tensors the round does not sum: {unknown}")
        parts = []
        for name, size in zip(p.names, p.sizes, strict=True):
            value = np.asarray(update[name], dtype=np.float64).ravel() if name in update else np.zeros(size)
            if value.size != size:
                raise ValueError(f"{name} has {value.size} values; the round sums {size}")
            parts.append(value)
        x = np.concatenate(parts) if parts else np.zeros(0)
        noise = self.noise
        if noise is not None:
            if weight != 1 or p.weighted:
                raise ValueError("a noised sum is a plain sum: every weight is 1")
            ints = noise.encode(x, uniforms)
        else:
            norm = float(np.linalg.norm(x))
            if norm > p.norm_bound:
                x = x * (p.norm_bound / norm)  # the node's own clip: the server cannot bound one update now
            ints = stochastic_round(weight * x / p.gamma, uniforms)
        weights = np.array([weight if name in update else 0 for name in p.names], dtype=np.int64)
        return encode(np.concatenate([ints, weights]), p.bits)

    def decode(self, total: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """(sums, weights) by tensor name (flat arrays), from the unmasked sum of residues."""
        p = self.plan
        signed = decode(total, p.bits)
        values, weights = signed[: self.dim].astype(np.float64) * p.gamma, signed[self.dim :]
        sums, at = {}, 0
        for name, size in zip(p.names, p.sizes, strict=True):
            sums[name] = values[at : at + size]
            at += size
        return sums, {name: float(w) for name, w in zip(p.names, weights, strict=True)}

    @property
    def length(self) -> int:
        """Coordinates of a node's vector: the tensors, then one weight per tensor."""
        return self.dim + len(self.plan.names)
