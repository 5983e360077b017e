"""Local image features: one embedding per image patch, in CLIP's joint space (FedOTP).

- open_clip VisionTransformer: the last layer's patch tokens after ``ln_post``, projected by
  ``proj`` (the same map that makes the pooled class-token feature);
- the embedded tiny CLIP's conv tower: every cell of the last feature map, projected;
- other image towers (ModifiedResNet / timm) are not supported: a clear error says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def encode_patch_tokens(model, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised patch embeddings [B, P, D] of a frozen CLIP image tower."""
    visual = model.visual
    if hasattr(visual, "forward_tokens"):
        tokens = visual.forward_tokens(pixels)
    elif hasattr(visual, "output_tokens") and hasattr(visual, "proj") and not getattr(visual, "attn_pool", None):
        old = visual.output_tokens
        visual.output_tokens = True
        try:
            _, tokens = visual(pixels)
        finally:
            visual.output_tokens = old
        if visual.proj is not None:
            tokens = tokens @ visual.proj
    else:
        raise NotImplementedError(
            f"patch features of a {type(visual).__name__} image tower are not supported (FedOTP needs "
            "per-patch embeddings); use a ViT CLIP (e.g. ViT-B-16) or the embedded tiny CLIP"
        )
    return F.normalize(tokens.float(), dim=-1)
