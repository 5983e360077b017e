"""Local image features: one embedding per image patch, in CLIP's joint space (FedOTP).

- open_clip VisionTransformer: the last layer's patch tokens after ``ln_post``, projected by
  ``proj`` (the same map that makes the pooled class-token feature);
- open_clip ModifiedResNet (RN50, RN101, ...): the attention pool computed at every cell of the
  last feature map, not only at the mean token it pools into the image feature (what PLOT's and
  FedOTP's code do for ResNet CLIPs): each cell attends over all cells and goes through the same
  projections, so it lands in the joint space;
- the embedded tiny CLIP's conv tower: every cell of the last feature map, projected;
- other image towers (timm) are not supported: validation refuses them for FedOTP
  (``methods.registry``), and a clear error says so here too.
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
    elif getattr(visual, "attnpool", None) is not None and hasattr(visual, "stem"):
        tokens = attention_pool_everywhere(visual, pixels)[:, 1:]
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
            "per-patch embeddings); use a ViT or ResNet CLIP (e.g. ViT-B-16, RN50) or the embedded tiny CLIP"
        )
    return F.normalize(tokens.float(), dim=-1)


def attention_pool_everywhere(visual, pixels: torch.Tensor) -> torch.Tensor:
    """[B, 1 + H*W, D]: open_clip's AttentionPool2d with every token as a query; its forward keeps
    only the first (the mean token), which is the pooled image feature."""
    x = visual.stem(pixels)
    x = visual.layer4(visual.layer3(visual.layer2(visual.layer1(x))))
    pool = visual.attnpool
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(2, 0, 1)  # [H*W, B, C]
    x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0) + pool.positional_embedding[:, None, :].to(x.dtype)
    out, _ = F.multi_head_attention_forward(
        query=x,
        key=x,
        value=x,
        embed_dim_to_check=x.shape[-1],
        num_heads=pool.num_heads,
        q_proj_weight=pool.q_proj.weight,
        k_proj_weight=pool.k_proj.weight,
        v_proj_weight=pool.v_proj.weight,
        in_proj_weight=None,
        in_proj_bias=torch.cat([pool.q_proj.bias, pool.k_proj.bias, pool.v_proj.bias]),
        bias_k=None,
        bias_v=None,
        add_zero_attn=False,
        dropout_p=0.0,
        out_proj_weight=pool.c_proj.weight,
        out_proj_bias=pool.c_proj.bias,
        use_separate_proj_weight=True,
        training=False,
        need_weights=False,
    )
    return out.permute(1, 0, 2)
