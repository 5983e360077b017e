"""Benchmark: simulated clients trained per second, for each method family, through ``flwr run``
(Ray, as users run it) and the in-process grid (no Ray: the clients' compute alone), on this
machine's CPU or, with ``--device cuda``, a GPU shared by several clients.

Each family runs its first method on its embedded default (``--model vit-b-16``: the prompt family
on open_clip's ViT-B/16 with random weights, the size of the real model): ``--clients`` nodes, all
trained every round, one evaluated, ``--rounds`` rounds. From the rounds after the first (the first
loads models and encodes features): clients trained per second (clients per round / the round's
wall time), what one client's training costs (the compute it reports), and where the rest of the
round goes (Flower, Ray, the server's aggregation). With a GPU, ``--gpus-per-client 0.25`` has Ray
put 4 clients on it at once (``client-resources-num-gpus``), and the GPU memory of the process tree
is sampled (nvidia-smi).

    python bench/clients_per_second.py                                      # every family, CPU
    python bench/clients_per_second.py --families prompt --device cuda --gpus-per-client 0.25
    python bench/clients_per_second.py --families prompt --model vit-b-16 --device cuda --gpus-per-client 0.05

Writes ``--out`` (JSON) and prints one line per family and engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from round_overhead import run_flwr, run_inprocess

from bench.measure import bench_report
from fedvlm.methods.registry import FAMILIES, methods_of
from fedvlm.utils.processes import DEFAULT_SHARE, ClientShare

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"embedded": {}, "vit-b-16": {"clip.model": "ViT-B-16", "clip.pretrained": ""}}  # random weights: offline


def throughput(data: dict) -> dict:
    """Clients per second and where a round's time goes, over the rounds after the first."""
    rounds = data["rounds"][1:] or data["rounds"]
    wall = np.array([r["seconds"] for r in rounds])
    trained = np.array([r["metrics"].get("train-clients", 0) for r in rounds])
    train = np.array([r["metrics"].get("train-compute-seconds", 0.0) for r in rounds])
    evaluate = np.array([r["metrics"].get("eval-compute-seconds", 0.0) for r in rounds])
    return {
        "clients_per_round": float(trained.mean()),
        "clients_per_s": round(float(trained.sum() / wall.sum()), 3),
        "round_s": round(float(wall.mean()), 3),
        "train_s_per_client": round(float(train.sum() / max(trained.sum(), 1)), 3),
        "evaluate_s_per_round": round(float(evaluate.mean()), 3),
        # client compute adds up over clients that ran at once: the rest is what Flower, Ray and
        # the server add (negative where several clients computed in parallel)
        "rest_s_per_round": round(float((wall - train - evaluate).mean()), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(f.name for f in FAMILIES.values()))
    p.add_argument("--model", choices=sorted(MODELS), default="embedded", help="the prompt family's CLIP")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu, or cuda")
    p.add_argument("--gpus-per-client", type=float, default=0.0, help="client-resources-num-gpus (cuda)")
    p.add_argument(
        "--cpus-per-client", type=int, default=0, help="client-resources-num-cpus, so its threads (0: ClientShare's)"
    )
    p.add_argument("--niceness", type=int, default=0, help="the simulated clients' niceness (Ray's default: 15)")
    p.add_argument("--engines", default="inprocess,flwr")
    p.add_argument("--out", type=Path, default=Path("clients_per_second.json"))
    p.add_argument("--cache-dir", default=os.environ.get("FEDVLM_CACHE", str(Path.home() / ".cache" / "fedvlm")))
    args = p.parse_args()
    if args.gpus_per_client and args.device != "cuda":
        p.error("--gpus-per-client shares a GPU: give --device cuda")
    share = ClientShare(args.cpus_per_client or DEFAULT_SHARE.threads, args.niceness)
    federation = f"client-resources-num-gpus={args.gpus_per_client}" if args.gpus_per_client else ""
    rows = []
    for name in args.families.split(","):
        method = methods_of(FAMILIES[name])[0].name
        extra = {
            "device": args.device,
            "fraction-train": 1.0,
            "fraction-evaluate": 1 / args.clients,
            **(MODELS[args.model] if name == "prompt" else {}),
        }
        for engine in args.engines.split(","):
            memory: dict = {}
            with tempfile.TemporaryDirectory() as tmp:
                if engine == "flwr":
                    data, wall = run_flwr(
                        method, args.rounds, Path(tmp), args.cache_dir, extra, args.clients, federation, memory, share
                    )
                else:
                    if args.device == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    data, wall = run_inprocess(method, args.rounds, Path(tmp), args.cache_dir, extra, args.clients)
                    if args.device == "cuda":  # every client in this process: what torch held at most
                        memory["gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
            row = {
                "family": name,
                "method": method,
                "model": args.model if name == "prompt" else "embedded",
                "engine": engine,
                "device": args.device,
                "federation": f"{share.federation()} {federation}".strip(),
                **share.record(),
                **throughput(data),
                "run_wall_s": round(wall, 1),
                **{f"peak_{k}": round(v) for k, v in memory.items()},
            }
            rows.append(row)
            print(
                f"{name:9s} {method:10s} {engine:9s} {row['clients_per_s']:.2f} clients/s "
                f"({row['clients_per_round']:.0f} per round in {row['round_s']:.2f} s: "
                f"{row['train_s_per_client']:.3f} s training each, {row['evaluate_s_per_round']:.2f} s evaluating, "
                f"{row['rest_s_per_round']:.2f} s the rest)"
                + "".join(f", peak {k.removeprefix('peak_')} {v}" for k, v in row.items() if k.startswith("peak_")),
                flush=True,
            )
    args.out.write_text(json.dumps(bench_report({"argv": sys.argv[1:], "rows": rows}), indent=2))


if __name__ == "__main__":
    main()
