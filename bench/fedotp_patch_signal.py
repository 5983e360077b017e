"""Experiment: why FedOTP scores below local CoOp on the embedded default.

FedOTP scores an image by transporting its patch embeddings to each class's two prompts
(``client_app.scoring.OTScorer``); CoOp scores the pooled image feature (``PromptScorer``).
Everything else equal, this fits one context per scoring path, on the same client's training
records (the pFedMoAP protocol's run config: pathological split, 16 shots, CoOp's SGD), with the
runs' prompt optimiser for the local steps a client trains over the protocol's rounds, starting
from the same context, and prints each path's test accuracy on the client's own
classes (argmax over all classes, as the runs score it); first the zero-shot accuracy of each path
with the hand-written template and no training. If the OT-over-patches path is weaker than the
pooled path here, with the federation, the global prompt and the averaging taken away, the
ceiling FedOTP can reach on this backbone is set by its image features, not by its federated
training. Both paths are the scorers the runs use, so nothing here is a second implementation.

With ``--runs``, it also reads finished FedOTP runs and scores each node's own test classes with
the prompts it published, as the run pairs them (the federation's global prompt and its local
one) and with its local prompt in both places: how much the averaged global prompt costs a node
at the end of the run. For each such run whose seed was fitted here, it prints the run's
own-class accuracy less that of the same split's clients fitted alone on FedOTP's scoring, paired
by seed with a 95% interval (``compared`` in the JSON).

With ``--set`` (run-config items over the protocol's, e.g. ``partitioner=iid``) and ``--seeds``, the
same fits run on another split and seeds; without ``--steps`` each client fits for the local steps it
trains over the protocol's run (rounds x local epochs x its batches a epoch), as its federated run
does. A federated run of the same config and seed beside it (``fedvlm.experiments.sweep`` with the
same ``--set``) is the other arm: what federating the global prompt costs a node, on one backbone.

Usage:
    python bench/fedotp_patch_signal.py                # clients 0..9, the protocol's 100 local steps
    python bench/fedotp_patch_signal.py --steps 400 --out fedotp_patch_signal.json
    python bench/fedotp_patch_signal.py --clients 0 --runs ~/fedvlm-protocols/paper-pfedmoap/runs/fedotp-*
    python bench/fedotp_patch_signal.py --seeds 0,1,2 --set partitioner=iid --out iid.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.attacks.global_model import trained_nodes
from fedvlm.client_app.node import NUM_PARTITIONS, PARTITION_ID, node_data
from fedvlm.client_app.prompt_clients import PromptClient
from fedvlm.client_app.scoring import OTScorer, PromptScorer
from fedvlm.experiments.protocols import PROTOCOLS
from fedvlm.experiments.stats import difference
from fedvlm.methods.validation import validate
from fedvlm.models.clip_loader import load_clip
from fedvlm.models.prompt_learner import TextTower, clip_logits, init_context
from fedvlm.runconfig import parse_value


def template_text(bundle, classnames: list[str], template: str) -> torch.Tensor:
    tokens = bundle.tokenizer([template.format(c) for c in classnames]).to(bundle.device)
    with torch.no_grad():
        return F.normalize(bundle.model.encode_text(tokens).float(), dim=-1)


def fit(cfg, scorer, prompts: dict, feats, labels, steps: int, seed: int, frozen: tuple[str, ...] = ()):
    """The runs' prompt optimiser on the prompts' contexts but ``frozen``, minibatches drawn with a
    fixed seed."""
    params = {k: v.clone().requires_grad_(k not in frozen) for k, v in prompts.items()}
    trained = [v for k, v in params.items() if k not in frozen]
    opt = PromptClient.make_optimizer(SimpleNamespace(cfg=cfg), trained)  # type: ignore[arg-type]
    batch = cfg.prompt.batch_size
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        pick = torch.from_numpy(rng.choice(len(labels), min(batch, len(labels)), replace=False))
        loss = F.cross_entropy(scorer.logits(params, feats[pick]), labels[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(-1) == labels).float().mean())


def run_steps(cfg, n_train: int) -> int:
    """The local steps a client trains over the run: the federated runs' plan (``methods.registry``)."""
    return cfg.num_server_rounds * cfg.prompt.local_epochs * math.ceil(n_train / cfg.prompt.batch_size)


def one_client(cfg, pid: int, n: int, steps: int | None) -> dict:
    node = node_data(cfg, {"partition-id": pid, "num-partitions": n})
    bundle = load_clip(cfg.clip.model, cfg.clip.pretrained, cfg.cache_path, cfg.device)
    classnames = node.splits.classnames
    pooled, ot = PromptScorer(bundle, classnames, cfg), OTScorer(bundle, classnames, cfg)
    train, test = node.part.train, node.part.test
    y_train = torch.from_numpy(node.splits.train.labels[train]).long()
    y_test = torch.from_numpy(node.splits.test.labels[test]).long()
    steps = steps or run_steps(cfg, len(train))
    cache = cfg.cache_path
    feats = {
        "pooled": (
            pooled.image_features(node.splits.train, train, cache),
            pooled.image_features(node.splits.test, test, cache),
        ),
        "patches": (
            ot.image_features(node.splits.train, train, cache),
            ot.image_features(node.splits.test, test, cache),
        ),
    }
    text = template_text(bundle, classnames, cfg.zeroshot.template)
    with torch.no_grad():
        zero = {
            "pooled": accuracy(clip_logits(feats["pooled"][1], text, bundle.logit_scale), y_test),
            "patches": accuracy(ot.ot_logits(feats["patches"][1], torch.stack([text, text])), y_test),
        }
    generator = torch.Generator().manual_seed(cfg.seed)
    ctx = init_context(TextTower.from_open_clip(bundle.model), bundle.tokenizer, cfg.prompt.n_ctx, generator=generator)
    trained = {}
    for path, scorer, prompts, frozen in (
        ("pooled", pooled, {"ctx": ctx}, ()),
        ("patches", ot, {"global": ctx, "local": ctx.clone()}, ()),
        # FedOTP's global half as this project's federation leaves it: barely moved from its start
        ("patches-global-frozen", ot, {"global": ctx, "local": ctx.clone()}, ("global",)),
    ):
        t0 = time.time()
        features = feats["pooled" if path == "pooled" else "patches"]
        fitted = fit(cfg, scorer, prompts, features[0], y_train, steps, cfg.seed + pid, frozen)
        with torch.no_grad():
            trained[path] = {
                "train": accuracy(scorer.logits(fitted, features[0]), y_train),
                "test": accuracy(scorer.logits(fitted, features[1]), y_test),
                "seconds": round(time.time() - t0, 1),
            }
    return {
        "client": pid,
        "classes": list(node.part.classes),
        "train": len(train),
        "test": len(test),
        "steps": steps,
        "zero-shot": zero,
        "fitted": trained,
    }


@torch.no_grad()
def probe_run(run_dir: Path) -> dict:
    """A finished FedOTP run's nodes scored with their published prompts: as paired, and local only."""
    data = json.loads((run_dir / "results.json").read_text())
    cfg = validate(data["config"])
    bundle = load_clip(cfg.clip.model, cfg.clip.pretrained, cfg.cache_path, cfg.device)
    rows = []
    for n in trained_nodes(data):
        node = node_data(cfg, {PARTITION_ID: int(n["partition_id"]), NUM_PARTITIONS: int(n["num_partitions"])})
        ot = OTScorer(bundle, node.splits.classnames, cfg)
        test = node.part.test
        feats = ot.image_features(node.splits.test, test, cfg.cache_path)
        labels = torch.from_numpy(node.splits.test.labels[test]).long()
        prompts = torch.load(run_dir / "published" / f"{n['name']}.pt", weights_only=False)["prompts"]
        rows.append(
            {
                "node": n["name"],
                "paired": accuracy(ot.logits(prompts, feats), labels),
                "local only": accuracy(
                    ot.logits({"global": prompts["local"], "local": prompts["local"]}, feats), labels
                ),
                "global only": accuracy(
                    ot.logits({"global": prompts["global"], "local": prompts["global"]}, feats), labels
                ),
            }
        )
    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("paired", "local only", "global only")}
    return {"run": run_dir.name, "seed": cfg.seed, "mean": mean, "nodes": rows}


def federated_minus_alone(seeds: list[dict], probed: list[dict]) -> dict:
    """Per seed, the federated run's own-class accuracy (its prompts as paired) less the same split's
    clients fitted alone on FedOTP's scoring, and that difference over seeds (paired, 95% interval)."""
    alone = {s["seed"]: s["mean"]["fitted-patches"] for s in seeds}
    federated = {r["seed"]: r["mean"]["paired"] for r in probed if r["seed"] in alone}
    diff = difference(federated, {s: alone[s] for s in federated})
    return {
        "federated": federated,
        "alone": {s: alone[s] for s in federated},
        "federated-minus-alone": diff.as_dict() if diff else None,
        "text": f"federated - alone, {len(federated)} seeds: {diff.interval(100)} points" if diff else "no pair",
    }


def fit_seed(protocol, sets: dict, seed: int, clients: int, steps: int | None) -> dict:
    """Every client of one seed's split fitted alone; the mean over clients of each path."""
    cfg = validate({k: parse_value(v) for k, v in sets.items()} | {"seed": seed})
    rows = []
    for pid in range(clients):
        r = one_client(cfg, pid, protocol.clients, steps)
        rows.append(r)
        z, f = r["zero-shot"], r["fitted"]
        fits = " ".join(f"{k} {100 * v['test']:.1f}% (train {100 * v['train']:.1f}%)" for k, v in f.items())
        print(
            f"seed {seed} client {pid} ({r['steps']} steps): zero-shot pooled {100 * z['pooled']:.1f}% "
            f"patches {100 * z['patches']:.1f}% | {fits}",
            flush=True,
        )
    summary = {f"zero-shot-{k}": float(np.mean([r["zero-shot"][k] for r in rows])) for k in ("pooled", "patches")}
    for k in rows[0]["fitted"] if rows else ():
        summary[f"fitted-{k}"] = float(np.mean([r["fitted"][k]["test"] for r in rows]))
    print(f"seed {seed}, mean over clients: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in summary.items()))
    return {"seed": seed, "mean": summary, "clients": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=10, help="clients 0..k-1 of the protocol's 10")
    p.add_argument("--steps", type=int, default=None, help="local steps (default: each client's over the run)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (each its own split and start)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config items over the protocol's")
    p.add_argument("--runs", type=Path, nargs="*", default=[], help="finished FedOTP runs to probe")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    protocol = PROTOCOLS["paper-pfedmoap"]
    sets = dict(s.split("=", 1) for s in (*protocol.sets, *args.set))
    seeds = [fit_seed(protocol, sets, int(s), args.clients, args.steps) for s in args.seeds.split(",")]
    probed = [probe_run(run_dir) for run_dir in args.runs]
    for r in probed:
        print(f"{r['run']}: own-class accuracy " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in r["mean"].items()))
    compared = federated_minus_alone(seeds, probed) if probed else None
    if compared:
        print(compared["text"])
    if args.out:
        out = {"argv": sys.argv[1:], "seeds": seeds, "runs": probed, "compared": compared}
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
