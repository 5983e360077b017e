"""pFedMoAP's private attention gate and its mixture-of-prompt-experts logits (docs/methods.md,
"pFedMoAP").

For every image and every class the gate attends from the image to that class's text features
under the node's own prompt and under each expert prompt, and mixes them into one text feature
T_MoE. Everything works in a "pooled" space of ``dim`` features: strided subsampling of the
already normalised CLIP features, ``x[..., ::D // dim]`` (the public code's pooling; not
re-normalised). Attention logits are ``scale * q.k`` with a fixed scale (10), not 1/sqrt(d_k).

    logits = s * <pool(I), T_MoE> + lambda * s * cos(I, T_local)     (T_MoE not normalised)

The gate is a plain module (four ``nn.Linear(dim, dim)`` with bias: 66,048 weights at dim 128),
with no dropout, LayerNorm or residual. Each record's loss depends only on its own image, so
its per-sample gradients are exact from one batched backward (``privacy.dpsgd``).
"""

from __future__ import annotations

import torch
from torch import nn


class GateShapeError(ValueError):
    """The gate cannot be built for this backbone; the message names the keys to change."""


class AttentionGate(nn.Module):
    def __init__(self, embed_dim: int, dim: int = 128, heads: int = 8, scale: float = 10.0):
        super().__init__()
        if dim > embed_dim or embed_dim % dim:
            raise GateShapeError(
                f"pfedmoap.gating-dim = {dim} must divide the CLIP embedding dimension {embed_dim} (the gate "
                f"subsamples every {embed_dim}/{dim}-th feature); pick a divisor of {embed_dim}"
            )
        if dim % heads:
            raise GateShapeError(f"pfedmoap.gating-dim = {dim} is not divisible by pfedmoap.gating-heads = {heads}")
        self.stride = embed_dim // dim
        self.heads = heads
        self.scale = scale
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., dim]: every (D/dim)-th feature."""
        return x[..., :: self.stride]

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """image [B, D], text [E, C, D] (E = the local prompt and the experts) -> T_MoE [B, C, dim]."""
        b, (e, c, _) = image.shape[0], text.shape
        h = self.heads
        q = self.q(self.pool(image)).view(b, h, -1)  # [B, H, dh]
        kv = self.pool(text)  # [E, C, dim]
        k = self.k(kv).view(e, c, h, -1)  # [E, C, H, dh]
        v = self.v(kv).view(e, c, h, -1)
        attn = torch.softmax(self.scale * torch.einsum("bhd,echd->bche", q, k), dim=-1)  # [B, C, H, E]
        mixed = torch.einsum("bche,echd->bchd", attn, v).reshape(b, c, -1)  # [B, C, dim]
        return self.o(mixed)


def moe_logits(
    gate: AttentionGate,
    image: torch.Tensor,
    local_text: torch.Tensor,
    expert_text: torch.Tensor,
    logit_scale: torch.Tensor | float,
    lam: float,
) -> torch.Tensor:
    """image [B, D], local_text [C, D], expert_text [K, C, D] (all normalised) -> logits [B, C]."""
    text = torch.cat([local_text.unsqueeze(0), expert_text])  # [1 + K, C, D]
    t_moe = gate(image, text)  # [B, C, dim]
    mixture = torch.einsum("bd,bcd->bc", gate.pool(image), t_moe)
    return logit_scale * mixture + lam * logit_scale * image @ local_text.t()
