"""Scoring images with a (published) prompt: the inference half of every prompt method.

A ``PromptScorer`` turns a method's prompts (a dict of context tensors, what a client
evaluates with and publishes) plus image features into CLIP logits over all classes. The
ClientApp evaluates through it, and the membership-inference attacks score a published
prompt through the very same code, with nothing but the public backbone.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.models.clip_loader import ClipBundle
from fedvlm.models.feature_cache import image_features
from fedvlm.models.optimal_transport import unbalanced_sinkhorn
from fedvlm.models.prompt_learner import PromptEncoder, TextTower, clip_logits
from fedvlm.runconfig import ConfigError, RunConfig
from fedvlm.tensor_names import CTX

_ENCODERS: dict[tuple, PromptEncoder] = {}


def prompt_encoder(bundle: ClipBundle, classnames: list[str], n_ctx: int) -> PromptEncoder:
    """One encoder per (backbone, class list, context length), shared by the process."""
    key = (bundle.fingerprint, str(bundle.device), tuple(classnames), n_ctx)
    if key not in _ENCODERS:
        _ENCODERS[key] = PromptEncoder(TextTower.from_open_clip(bundle.model), bundle.tokenizer, classnames, n_ctx)
    return _ENCODERS[key]


class PromptScorer:
    """Single-context methods: logits = scale * cos(image, text(ctx))."""

    def __init__(self, bundle: ClipBundle, classnames: list[str], cfg: RunConfig):
        self.bundle = bundle
        self.classnames = list(classnames)
        self.cfg = cfg
        self.scale = bundle.logit_scale

    def encoder(self, ctx: torch.Tensor) -> PromptEncoder:
        return prompt_encoder(self.bundle, self.classnames, ctx.shape[-2])

    def text(self, ctx: torch.Tensor) -> torch.Tensor:
        ctx = ctx.to(self.bundle.device)
        return self.encoder(ctx)(ctx)

    def image_features(self, split, indices: np.ndarray, cache_dir) -> torch.Tensor:
        """What ``logits`` takes for these images (cached): pooled features [n, D]."""
        return image_features(self.bundle, split, indices, cache_dir, self.cfg.clip.image_batch_size)

    def logits(self, prompts: dict[str, torch.Tensor], feats: torch.Tensor) -> torch.Tensor:
        return clip_logits(feats, self.text(prompts[CTX]), self.scale)


class TemplateScorer(PromptScorer):
    """Zero-shot CLIP: the hand-written template instead of a learned context."""

    def __init__(self, bundle: ClipBundle, classnames: list[str], cfg: RunConfig):
        super().__init__(bundle, classnames, cfg)
        self._text: torch.Tensor | None = None

    @torch.no_grad()
    def template_text(self) -> torch.Tensor:
        """Each class's text feature, encoded once. A template that pushes a class name past the
        text context is refused: the tokenizer would cut the name off without a word, every class
        would read the same, and accuracy would be chance with a run that looks finished."""
        if self._text is None:
            texts = [self.cfg.zeroshot.template.format(c) for c in self.classnames]
            tokens = self.bundle.tokenizer(texts)
            encode = getattr(self.bundle.tokenizer, "encode", None)
            if encode is not None:  # open_clip's tokenizers truncate silently
                needed, longest = max((len(encode(t)) + 2, t) for t in texts)
                if needed > tokens.shape[1]:
                    raise ConfigError(
                        f"run config 'zeroshot.template' makes {longest[:80]!r} {needed} tokens long, and the text "
                        f"context holds {tokens.shape[1]}: the class name would be cut off; shorten the template"
                    )
            encoded = self.bundle.model.encode_text(tokens.to(self.bundle.device))  # type: ignore[operator]  # open_clip
            self._text = F.normalize(encoded.float(), dim=-1)
        return self._text

    def logits(self, prompts, feats):
        return clip_logits(feats, self.template_text(), self.scale)


class OTScorer(PromptScorer):
    """FedOTP: each class has a global and a local prompt; an image's patch embeddings are
    transported to the two prompts' text features (unbalanced OT) and the class score is
    the plan-weighted similarity."""

    def image_features(self, split, indices, cache_dir):
        return image_features(
            self.bundle, split, indices, cache_dir, self.cfg.clip.image_batch_size, kind="patch-tokens"
        )

    def logits(self, prompts, feats):
        text = torch.stack([self.text(prompts["global"]), self.text(prompts["local"])])  # [2, C, D]
        return self.ot_logits(feats, text)

    def ot_logits(self, patches: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """patches [B, P, D], text [N=2, C, D] (both normalised) -> logits [B, C]."""
        sim = torch.einsum("bpd,ncd->bcpn", patches, text)  # [B, C, P, N]
        plan = unbalanced_sinkhorn(1.0 - sim.detach(), self.cfg.fedotp.eps, self.cfg.fedotp.tau, self.cfg.fedotp.iters)
        # balanced plans have mass 1 (the score is a plan-weighted mean cosine, like CLIP's);
        # the KL-relaxed plan moves more mass between well-matched pairs, less between poor ones
        return self.scale * (plan * sim).sum(dim=(-1, -2))
