"""Benchmark: one DP-SGD step of model reprogramming against full fine-tuning, side by side.

Each model kind takes the same batch through the DP-SGD module every client uses
(``privacy.dpsgd``): per-sample gradients of every trainable parameter (Opacus hooks, or
ExpandedWeights for the full network), per-sample clipping to C, Gaussian noise, one SGD step.
Printed per source model: seconds per step of ``mr`` (reprogramming), ``pf`` (bl-pf) and ``ff``
(bl-ff, the same network as bl-ts), the ratio ff / mr, and the trainable parameter counts (the
paper's Table IV).

Usage:
    python bench/reprogram_step.py                                # embedded ResNets and ResNet-18
    python bench/reprogram_step.py --sources resnet50 --batch 64 --device cuda

Random weights are fine for timing; the ratio is what matters.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fedvlm.models.reprogram import build_model, input_size, load_source, trainable_state
from fedvlm.privacy.dpsgd import DPStep, ModuleGradients, privatize


def step_seconds(kind: str, source, batch: int, classes: int, image_size: int, steps: int, device: str) -> float:
    model = build_model(kind, source, classes, image_size, seed=0).to(device).train()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    shapes = {k: p.shape for k, p in params.items()}
    # C = 1, z = 1.1: the noise std on the clipped sum / B is z * C / B
    step = DPStep(clip=1.0, expected_batch=batch, sigma=1.1 / batch, groups=(tuple(params),), noised=frozenset(params))
    opt = torch.optim.SGD(list(params.values()), lr=0.15)
    size = input_size(kind, source, image_size)
    x = torch.rand(batch, 3, size, size, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    grads = ModuleGradients(model)
    net = grads.attach()
    noise = torch.Generator().manual_seed(0)
    times = []
    try:
        for i in range(steps + 1):  # the first step warms up
            t0 = time.perf_counter()
            losses = F.cross_entropy(net(x), y, reduction="none")
            per = grads.per_sample(
                params,
                lambda i: F.cross_entropy(net(x[i]), y[i], reduction="none"),
                torch.arange(batch).numpy(),
                losses,
            )
            update, _ = privatize(per, step, noise, shapes)
            for k, p in params.items():
                p.grad = update[k]
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        grads.detach()
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", default="embedded-tiny-resnet,embedded-motif-resnet,resnet18")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name in args.sources.split(","):
            source = load_source(name, "random", Path(cache))
            image_size = 24 if source.input_size == 32 else 200
            row = {"source": name, "batch": args.batch, "device": args.device}
            # what trains: reprogramming (mr), partial fine-tune (pf), full fine-tune (ff; the
            # from-scratch baseline trains the same network)
            for kind in ("mr", "pf", "ff"):
                model = build_model(kind, source, args.classes, image_size, seed=0)
                row[f"{kind} params"] = sum(v.numel() for v in trainable_state(model).values())
                row[f"{kind} s/step"] = round(
                    step_seconds(kind, source, args.batch, args.classes, image_size, args.steps, args.device), 4
                )
            row["ff / mr time"] = round(row["ff s/step"] / row["mr s/step"], 2)
            row["ff / mr params"] = round(row["ff params"] / row["mr params"], 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = list(rows[0])
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
