"""Benchmark: one prompt-learning step, ours against a naive CoOp-style step, and its DP-SGD
cost, side by side in one process.

Both steps do the same thing: a batch of images, class prompts with the learnable context
spliced in, CLIP logits, cross-entropy, backward into the context, one SGD step.
- naive (what CoOp's reference code does every step): run the frozen image tower on the
  batch, and the text tower over the full 77-token context;
- ours: image features come from the feature cache (computed once per client), and the
  text tower stops at the last end-of-text token (no number changes; see prompt_learner).

DP-SGD (``privacy.dpsgd``): per-sample gradients of the context, clipping, noise, one SGD step.
Its floor is about B backward passes through the text tower over the C class prompts; printed:
DP step / non-DP step, DP step / (B x non-DP step), and the per-sample VJPs run the three ways
``privacy.dpsgd.functional_per_sample`` can: what clients run on this device (chunks of
``per_sample_chunk``), all B at once (vmap), and one record at a time.

Usage:
    python bench/prompt_step.py                       # embedded tiny CLIP and ViT-B/16
    python bench/prompt_step.py --models ViT-B-16 --device cuda --steps 20

Random weights are fine for timing (``pretrained=None``); the ratio is what matters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.measure import bench_report
from fedvlm.models import tiny_clip
from fedvlm.models.prompt_learner import PromptEncoder, TextTower, clip_logits, init_context
from fedvlm.privacy.dpsgd import DPStep, functional_per_sample, per_sample_chunk, privatize

CLASSNAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "grey", "pink", "brown", "purple"]


def class_names(k: int) -> list[str]:
    """k class names (up to 110): CIFAR-10's, then coloured variants of them."""
    return [CLASSNAMES[i] if i < 10 else f"{COLOURS[(i - 10) // 10]} {CLASSNAMES[i % 10]}" for i in range(k)]


class NaiveCoOp(torch.nn.Module):
    """CoOp as its reference code runs: full-length prompts, images re-encoded every step."""

    def __init__(self, model, tokenizer, n_ctx, names):
        super().__init__()
        self.model = model
        self.tower = TextTower.from_open_clip(model)
        self.n_classes = len(names)
        texts = [" ".join(["X"] * n_ctx) + f" {c}." for c in names]
        self.ids = tokenizer(texts)  # padded to the full context (77 for CLIP)
        with torch.no_grad():
            emb = self.tower.token_embedding(self.ids.to(self.tower.token_embedding.weight.device))
        self.prefix, self.suffix = emb[:, :1], emb[:, 1 + n_ctx :]
        self.eot = self.ids.argmax(-1)

    def text_features(self, ctx):
        x = torch.cat([self.prefix, ctx.unsqueeze(0).expand(self.n_classes, -1, -1), self.suffix], 1)
        return F.normalize(self.tower.encode_embeddings(x, self.eot.to(x.device)), dim=-1)


def _model(name: str, device: str):
    if name == "embedded-tiny":
        model = tiny_clip.build_tiny_clip()
        return model, tiny_clip.tokenizer(), 32
    import open_clip

    model = open_clip.create_model(name, pretrained=None)
    size = model.visual.image_size
    return model, open_clip.get_tokenizer(name), size[0] if isinstance(size, (tuple, list)) else size


def _time(fn, steps: int, device: str) -> float:
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def bench(name: str, device: str, batch: int, steps: int, classes: int = 10, n_ctx: int = 16) -> dict:
    names = class_names(classes)
    torch.manual_seed(0)
    model, tok, size = _model(name, device)
    model = model.to(device).eval().requires_grad_(False)
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, classes, (batch,), device=device)
    scale = float(model.logit_scale.exp())
    tower = TextTower.from_open_clip(model)
    ctx0 = init_context(tower, tok, n_ctx, generator=torch.Generator().manual_seed(0)).to(device)

    naive = NaiveCoOp(model, tok, n_ctx, names)
    ctx_a = ctx0.clone().requires_grad_(True)
    opt_a = torch.optim.SGD([ctx_a], lr=0.002, momentum=0.9)

    def naive_step():
        with torch.no_grad():
            img = F.normalize(model.encode_image(images), dim=-1)
        loss = F.cross_entropy(clip_logits(img, naive.text_features(ctx_a), scale), labels)
        opt_a.zero_grad()
        loss.backward()
        opt_a.step()

    encoder = PromptEncoder(tower, tok, names, n_ctx)
    with torch.no_grad():
        cached = F.normalize(model.encode_image(images), dim=-1)  # the feature cache, filled once
    ctx_b = ctx0.clone().requires_grad_(True)
    opt_b = torch.optim.SGD([ctx_b], lr=0.002, momentum=0.9)

    def our_step():
        loss = F.cross_entropy(clip_logits(cached, encoder(ctx_b), scale), labels)
        opt_b.zero_grad()
        loss.backward()
        opt_b.step()

    ctx_c = ctx0.clone().requires_grad_(True)
    opt_c = torch.optim.SGD([ctx_c], lr=0.002, momentum=0.9)
    dp = DPStep(clip=1.0, expected_batch=batch, sigma=0.1, groups=(("ctx",),), noised=frozenset({"ctx"}))
    noise = torch.Generator().manual_seed(0)

    def dp_step(per_sample):
        text = encoder(ctx_c)
        losses = F.cross_entropy(clip_logits(cached, text, scale), labels, reduction="none")
        update, _ = privatize(per_sample(losses, text), dp, noise, {"ctx": ctx_c.shape})
        opt_c.zero_grad()
        ctx_c.grad = update["ctx"]
        opt_c.step()

    def chunked(chunk):
        return lambda losses, text: functional_per_sample(losses, {"ctx": ctx_c}, [text], chunk=chunk)

    t_naive = _time(naive_step, steps, device)
    t_ours = _time(our_step, steps, device)
    t_dp = _time(lambda: dp_step(chunked(None)), steps, device)  # what clients run here
    t_vmap = _time(lambda: dp_step(chunked(batch)), steps, device)
    t_loop = _time(lambda: dp_step(chunked(1)), steps, device)
    # same numbers: the same first step from the same context gives the same gradient
    return {
        "model": name,
        "device": device,
        "batch": batch,
        "classes": classes,
        "text_tokens_naive": int(naive.ids.shape[1]),
        "text_tokens_ours": int(encoder.token_ids.shape[1]),
        "naive_s_per_step": round(t_naive, 5),
        "ours_s_per_step": round(t_ours, 5),
        "speedup": round(t_naive / t_ours, 2),
        "dp_s_per_step": round(t_dp, 5),
        "dp_over_nondp": round(t_dp / t_ours, 2),
        "dp_over_b_nondp": round(t_dp / (batch * t_ours), 3),
        "chunk": per_sample_chunk(torch.device(device), batch),
        "vmap_dp_s_per_step": round(t_vmap, 5),
        "loop_dp_s_per_step": round(t_loop, 5),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["embedded-tiny", "ViT-B-16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10, help="class prompts (the embedded default has 40)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        row = bench(name, args.device, args.batch, args.steps, args.classes)
        rows.append(row)
        print(
            f"{name:14s} {args.device}, {args.classes} classes: naive {row['naive_s_per_step']:.4f} s/step "
            f"({row['text_tokens_naive']} text tokens, images re-encoded) | ours {row['ours_s_per_step']:.4f} s/step "
            f"({row['text_tokens_ours']} tokens, cached features) | speed-up x{row['speedup']}",
            flush=True,
        )
        print(
            f"{'':14s} DP-SGD: {row['dp_s_per_step']:.4f} s/step = x{row['dp_over_nondp']} the non-DP step = "
            f"{row['dp_over_b_nondp']} x (B x non-DP step) | VJPs {row['chunk']} records at a time (what clients "
            f"run here); all {args.batch} at once {row['vmap_dp_s_per_step']:.4f} s/step, one at a time "
            f"{row['loop_dp_s_per_step']:.4f} s/step",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(bench_report(rows), indent=2))


if __name__ == "__main__":
    main()
