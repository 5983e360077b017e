"""Benchmark: how much of one DP-SGD step is signal, per Reprogrammable-FL method and source.

DP-SGD's update is (sum of per-sample gradients clipped to C) / B + N(0, (z C / B)^2 I_d).
At the run's initial model, on real batches of the target task, this prints per method:
the median per-sample gradient norm (how hard clipping cuts), the norm of the clipped mean
(the signal a step carries), the expected norm of the noise z C sqrt(d) / B, and their ratio.
For reprogramming and partial fine-tuning, whose trained head is a linear layer on a frozen
network's output (source logits, features), also that input's norm: the noise a step adds to the
layer's weights reaches every target logit multiplied by it. And the ceiling that input sets
without any DP: the test accuracy of a logistic-regression probe fitted on it over the whole
training set (for reprogramming, with the input program at zero, as it starts).

Usage:
    python bench/reprogram_signal.py                           # motifs task, the motif sources
    python bench/reprogram_signal.py --sources embedded-tiny-resnet --dataset digits

It reads the pretrained embedded sources from the cache (pretraining them on first use).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.client_app.reprogram_clients import resized
from fedvlm.data.registry import load_dataset
from fedvlm.models.reprogram import build_model, input_size, load_source, trainable_state
from fedvlm.privacy.dpsgd import ModuleGradients, per_sample_clip
from fedvlm.utils.paths import default_cache_dir

KINDS = {"mr": "reprogram", "pf": "bl-pf", "ff": "bl-ff", "ts": "bl-ts"}


def measure(kind: str, source, splits, rows: np.ndarray, batch: int, clip: float, z: float, lr: float) -> dict:
    classes = splits.n_classes
    model = build_model(kind, source, classes, 24, seed=0).train()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    size = input_size(kind, source, 24)
    x = torch.stack([resized(splits.train, i, size) for i in rows]).float().div_(255.0)
    y = torch.from_numpy(splits.train.labels[rows])
    grads = ModuleGradients(model)
    net = grads.attach()
    try:
        per, norms = [], []
        for lo in range(0, len(rows), batch):
            idx = np.arange(lo, min(lo + batch, len(rows)))
            losses = F.cross_entropy(net(x[idx]), y[idx], reduction="none")
            g = grads.per_sample(params, lambda i: F.cross_entropy(net(x[i]), y[i], reduction="none"), idx - lo, losses)
            flat = torch.cat([g[k].reshape(len(idx), -1) for k in params], 1).detach()
            norms.append(flat.norm(dim=1))
            per.append(per_sample_clip(flat, clip)[0])
    finally:
        grads.detach()
    clipped, norm = torch.cat(per), torch.cat(norms)
    d = clipped.shape[1]
    signal = float(clipped.mean(0).norm())
    noise = z * clip * d**0.5 / batch
    out = {
        "method": KINDS[kind],
        "trainable": sum(v.numel() for v in trainable_state(model).values()),
        "median per-sample norm": round(float(norm.median()), 2),
        "clipped share": round(float((norm > clip).float().mean()), 3),
        "signal": round(signal, 3),
        "noise": round(noise, 3),
        "signal / noise": round(signal / noise, 4),
    }
    if kind in ("mr", "pf"):  # a linear layer on frozen outputs: its input scales its noise
        width = float(head_input(kind, model, x).norm(dim=1).median())
        out["head input norm"] = round(width, 1)
        # the noise one step adds to the map's weights reaches each target logit with std
        # lr * z C / B * |input|
        out["target-logit noise per step"] = round(lr * z * clip / batch * width, 3)
        out["probe accuracy, no DP"] = round(probe(kind, model, splits, size), 3)
    return out


@torch.no_grad()
def head_input(kind: str, model, x: torch.Tensor) -> torch.Tensor:
    """What the trained linear head reads: source logits (reprogram) or source features (bl-pf)."""
    return model.source(model.normalise(model.program(x))) if kind == "mr" else model.body(model.normalise(x))


def probe(kind: str, model, splits, size: int) -> float:
    """Test accuracy of logistic regression on the head's frozen input, fitted on all training images.

    No noise, no clipping, no step budget: what a perfect head on this input could reach.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    def read(part) -> np.ndarray:
        chunks = []
        for lo in range(0, len(part), 256):
            x = torch.stack([resized(part, i, size) for i in range(lo, min(lo + 256, len(part)))])
            chunks.append(head_input(kind, model, x.float().div_(255.0)).numpy())
        return np.concatenate(chunks)

    scale = StandardScaler().fit(train := read(splits.train))
    fit = LogisticRegression(max_iter=3000).fit(scale.transform(train), splits.train.labels)
    return float(fit.score(scale.transform(read(splits.test)), splits.test.labels))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", default="embedded-motif-resnet,embedded-motif-resnet-ls")
    p.add_argument("--dataset", default="motifs")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--samples", type=int, default=128, help="training images measured (in batches of --batch)")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--noise-multiplier", type=float, default=1.1)
    p.add_argument("--lr", type=float, default=0.15)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = p.parse_args(argv)
    torch.manual_seed(0)
    splits = load_dataset(args.dataset)
    rows = np.random.default_rng(0).choice(len(splits.train), args.samples, replace=False)
    table = []
    for name in args.sources.split(","):
        source = load_source(name, "auto", args.cache_dir)
        for kind in KINDS:
            row = {
                "source": name,
                **measure(kind, source, splits, rows, args.batch, args.clip, args.noise_multiplier, args.lr),
            }
            print(json.dumps(row), flush=True)
            table.append(row)
    cols = list(dict.fromkeys(k for r in table for k in r))
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in table:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
