"""The one CLIP prompt-learning core (CoOp style) shared by every CLIP method.

A prompt for class c is ``[SOS] ctx_1 .. ctx_M [name tokens of c] . [EOS]``: the M context
vectors are learnable, everything else is the frozen token embedding of the class name.

The pieces:
- ``TextTower``: the frozen parts of an open_clip text encoder (token and positional
  embedding, transformer, final LayerNorm, projection), taken from either a ``CLIP`` or a
  ``CustomTextCLIP``.
- ``PromptEncoder``: turns a context tensor (shared ``[M, d]`` or class-specific
  ``[C, M, d]``) into one normalised text feature per class. It holds no trainable state:
  methods own their context parameters (PromptFL one prompt, DP-FPL a global prompt plus
  a factorised local prompt, pFedMoAP several experts) and pass whatever they compose.
- ``init_context``: random N(0, 0.02) or phrase initialisation ("a photo of a").
- ``clip_logits``: logit_scale * cos(image, text).

Speed: with a causal text transformer the feature at the EOT position cannot see the tokens
after it, so the encoder cuts every sequence at the longest EOT position in the class set.
On the 77-token CLIP context with short class names this removes most of the text compute
and changes no number (a test checks it against open_clip's own ``encode_text``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PLACEHOLDER = "X"  # one BPE token in CLIP's vocabulary; marks where the context goes


@dataclass
class TextTower:
    """The frozen pieces of an open_clip text encoder."""

    token_embedding: nn.Embedding
    positional_embedding: torch.Tensor  # [L, d]
    transformer: nn.Module
    ln_final: nn.Module
    text_projection: torch.Tensor | nn.Module | None
    attn_mask: torch.Tensor | None  # additive causal mask [L, L], or None (bidirectional)
    pool_type: str  # "argmax" (EOT has the largest id) or "eos"
    eos_id: int | None

    @classmethod
    def from_open_clip(cls, model: nn.Module) -> TextTower:
        """Take the text tower out of an open_clip CLIP or CustomTextCLIP model."""
        src: Any = getattr(model, "text", model)  # CustomTextCLIP keeps it in .text
        if not hasattr(src, "token_embedding"):
            raise NotImplementedError(
                f"{type(getattr(model, 'text', model)).__name__} text towers (Hugging Face "
                "text encoders) are not supported by the prompt learner: it needs an "
                "open_clip TextTransformer. Choose a CLIP model with an open_clip text tower "
                "(e.g. ViT-B-16, RN50, ViT-L-14)."
            )
        if getattr(src, "cls_emb", None) is not None:
            raise NotImplementedError("text towers with an appended CLS token (CoCa) are not supported")
        pool = getattr(src, "text_pool_type", None) or getattr(src, "pool_type", "argmax")
        if pool not in ("argmax", "eos"):
            raise NotImplementedError(
                f"text pooling {pool!r} is not supported by the prompt learner; "
                "it supports 'argmax' and 'eos' (the pooling of CLIP-style models)"
            )
        eos = getattr(src, "text_eos_id", None) if hasattr(src, "text_eos_id") else getattr(src, "eos_id", None)
        return cls(
            token_embedding=src.token_embedding,
            positional_embedding=src.positional_embedding,
            transformer=src.transformer,
            ln_final=src.ln_final,
            text_projection=src.text_projection,
            attn_mask=src.attn_mask,
            pool_type=pool,
            eos_id=eos,
        )

    @property
    def width(self) -> int:
        return self.token_embedding.weight.shape[1]

    @property
    def context_length(self) -> int:
        return self.positional_embedding.shape[0]

    def eot_positions(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Position of the pooled (end-of-text) token in each tokenized sequence."""
        if self.pool_type == "argmax":
            return token_ids.argmax(dim=-1)
        assert self.eos_id is not None  # "eos" pooling needs the EOS id (open_clip asserts it too)
        return (token_ids == self.eos_id).int().argmax(dim=-1)

    def encode_embeddings(self, x: torch.Tensor, eot: torch.Tensor) -> torch.Tensor:
        """Run the tower on token embeddings ``x`` [n, L, d]; returns features at ``eot``."""
        length = x.shape[1]
        cast = self.positional_embedding.dtype
        x = x.to(cast) + self.positional_embedding[:length]
        mask = None if self.attn_mask is None else self.attn_mask[:length, :length]
        x = self.transformer(x, attn_mask=mask)
        x = self.ln_final(x)
        x = x[torch.arange(x.shape[0], device=x.device), eot]
        if self.text_projection is None:
            return x
        if isinstance(self.text_projection, nn.Module):
            return self.text_projection(x)
        return x @ self.text_projection


class PromptEncoder(nn.Module):
    """Encodes ``[SOS] ctx [class name] . [EOS]`` prompts for a fixed list of class names.

    The token embeddings of everything but the context are computed once and kept as
    buffers (``prefix`` = SOS, ``suffix`` = name, period, EOS, padding).
    """

    prefix: torch.Tensor
    suffix: torch.Tensor
    eot: torch.Tensor
    token_ids: torch.Tensor

    def __init__(self, tower: TextTower, tokenizer, classnames: list[str], n_ctx: int):
        super().__init__()
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        self.tower = tower
        self.n_ctx = n_ctx
        self.classnames = list(classnames)
        placeholder = " ".join([PLACEHOLDER] * n_ctx)
        texts = [f"{placeholder} {name.replace('_', ' ')}." for name in self.classnames]
        ids = tokenizer(texts)
        if ids.shape[1] > tower.context_length:
            raise ValueError("tokenizer context is longer than the text tower's")
        if hasattr(tokenizer, "encode"):  # open_clip's tokenizer silently truncates
            needed = max(len(tokenizer.encode(t)) + 2 for t in texts)
            if needed > ids.shape[1]:
                raise ValueError(
                    f"a prompt with {n_ctx} context tokens needs {needed} tokens but the text "
                    f"context holds {ids.shape[1]}; use fewer context tokens (prompt.n-ctx, or a shorter "
                    "prompt.ctx-init phrase, whose token count sets it) or shorter class names"
                )
        eot = tower.eot_positions(ids)
        ph_id = tokenizer([PLACEHOLDER])[0, 1]
        if not bool((ids[:, 1 : 1 + n_ctx] == ph_id).all()):
            raise NotImplementedError(
                "this tokenizer does not map the context placeholder to one token per slot "
                "right after the start token; the prompt learner needs a CLIP BPE tokenizer"
            )
        # Causal mask: positions after the last EOT never influence a pooled feature.
        keep = int(eot.max()) + 1 if tower.attn_mask is not None else ids.shape[1]
        ids = ids[:, :keep]
        device = tower.token_embedding.weight.device
        with torch.no_grad():
            emb = tower.token_embedding(ids.to(device))
        self.register_buffer("prefix", emb[:, :1].clone(), persistent=False)
        self.register_buffer("suffix", emb[:, 1 + n_ctx :].clone(), persistent=False)
        self.register_buffer("eot", eot.to(device), persistent=False)
        self.register_buffer("token_ids", ids.to(device), persistent=False)

    @property
    def n_classes(self) -> int:
        return len(self.classnames)

    def assemble(self, ctx: torch.Tensor) -> torch.Tensor:
        """Token embeddings [C, L, d] of all class prompts for context ``ctx``."""
        if ctx.dim() == 2:
            ctx = ctx.unsqueeze(0).expand(self.n_classes, -1, -1)
        elif ctx.dim() != 3 or ctx.shape[0] != self.n_classes:
            raise ValueError(
                f"context must be [n_ctx, width] or [n_classes={self.n_classes}, n_ctx, width], got {tuple(ctx.shape)}"
            )
        if ctx.shape[1] != self.n_ctx:
            raise ValueError(f"context has {ctx.shape[1]} tokens, the encoder was built for {self.n_ctx}")
        return torch.cat([self.prefix, ctx.to(self.prefix.dtype), self.suffix], dim=1)

    def forward(self, ctx: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """Text features [C, D] of every class under context ``ctx``."""
        feats = self.tower.encode_embeddings(self.assemble(ctx), self.eot)
        return F.normalize(feats, dim=-1) if normalize else feats

    def encode_many(self, ctxs: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """Text features [K, C, D] of K contexts ``ctxs`` [K, ...ctx shape] in one pass through
        the tower (pFedMoAP's experts: one large batch instead of K small ones)."""
        x = torch.cat([self.assemble(c) for c in ctxs])  # [K * C, L, d]
        feats = self.tower.encode_embeddings(x, self.eot.repeat(len(ctxs)))
        feats = feats.view(len(ctxs), self.n_classes, -1)
        return F.normalize(feats, dim=-1) if normalize else feats


def init_context(
    tower: TextTower,
    tokenizer,
    n_ctx: int,
    phrase: str = "",
    n_classes: int = 0,
    std: float = 0.02,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Initial context: the embeddings of ``phrase`` or N(0, std^2) draws.

    With a phrase the context length is the phrase's token count (as in CoOp) and ``n_ctx``
    is ignored. ``n_classes > 0`` gives class-specific context ``[n_classes, M, d]``.
    """
    if phrase:
        ids = tokenizer([phrase])
        n = int(tower.eot_positions(ids)[0]) - 1
        with torch.no_grad():
            base = tower.token_embedding(ids[0, 1 : 1 + n].to(tower.token_embedding.weight.device))
        base = base.detach().float().cpu().clone()
        return base.unsqueeze(0).repeat(n_classes, 1, 1) if n_classes else base
    shape = (n_classes, n_ctx, tower.width) if n_classes else (n_ctx, tower.width)
    return torch.randn(shape, generator=generator) * std


def clip_logits(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor | float
) -> torch.Tensor:
    """CLIP logits: ``logit_scale * cos(image, text)``; both inputs already normalised."""
    return logit_scale * image_features @ text_features.t()
