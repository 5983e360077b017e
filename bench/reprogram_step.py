"""Benchmark: one DP-SGD step of model reprogramming against full fine-tuning, side by side.

Each model kind takes the same Poisson-sized batch through the same Opacus machinery a client
uses (``client_app.reprogram_clients``): per-sample gradients of every trainable parameter,
per-sample clipping to C, Gaussian noise, one SGD step. Printed per source model: seconds per
step of ``mr`` (reprogramming), ``pf`` (bl-pf) and ``ff`` (bl-ff, the same network as bl-ts),
the ratio ff / mr, and the trainable parameter counts (the paper's Table IV).

Usage:
    python bench/reprogram_step.py                                # embedded tiny ResNet and ResNet-18
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedvlm.models.reprogram import build_model, input_size, load_source, trainable_state  # noqa: E402


def step_seconds(kind: str, source, batch: int, classes: int, image_size: int, steps: int, device: str) -> float:
    from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights
    from opacus.optimizers import DPOptimizer

    model = build_model(kind, source, classes, image_size, seed=0).to(device)
    wrapper = GradSampleModuleExpandedWeights if kind in ("ff", "ts") else GradSampleModule
    gsm = wrapper(model, batch_first=True, loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.15),
                      noise_multiplier=1.1, max_grad_norm=1.0, expected_batch_size=batch)
    size = input_size(kind, source, image_size)
    x = torch.rand(batch, 3, size, size, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    gsm.train()
    times = []
    for i in range(steps + 1):  # the first step warms up
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x), y).backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", default="embedded-tiny-resnet,resnet18")
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
                row[f"{kind} s/step"] = round(step_seconds(kind, source, args.batch, args.classes, image_size,
                                                           args.steps, args.device), 4)
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
