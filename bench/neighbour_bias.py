"""Experiment: where a personalised prompt's neighbour accuracy goes (DP-FPL's second headline).

A node's "neighbor" accuracy scores its prompt on the other nodes' test classes, with the argmax
over all classes (DP-FPL's protocol). A personalised prompt (DP-FPL's global + low-rank local
part, FedPGP's) is trained on the node's own classes only; this measures, on finished runs, how
much of its neighbour error lands on those own classes, which are never right there: per node,
the neighbour accuracy of the prompt the node evaluates with (its published one), of the
federation's global prompt alone (``final_shared.pt``), and the share of neighbour images each
predicts into the node's own classes (chance share, for a prompt with no pull: own classes / all
classes). Scoring goes through the runs' own scorer (``client_app.scoring``).

Usage:
    python bench/neighbour_bias.py RUN_DIR [RUN_DIR ...] [--out neighbour_bias.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.measure import bench_report
from fedvlm.attacks.global_model import trained_nodes
from fedvlm.client_app.node import NUM_PARTITIONS, PARTITION_ID, node_data
from fedvlm.client_app.scoring import PromptScorer
from fedvlm.methods.validation import validate
from fedvlm.models.clip_loader import load_clip
from fedvlm.tensor_names import CTX, GLOBAL_CTX
from fedvlm.utils.files import load_saved


def shares(logits: torch.Tensor, labels: np.ndarray, own: tuple[int, ...]) -> tuple[float, float]:
    """(accuracy, share of images predicted into ``own``)."""
    pred = logits.argmax(-1).numpy()
    return float((pred == labels).mean()), float(np.isin(pred, own).mean())


@torch.no_grad()
def one_run(run_dir: Path) -> dict:
    data = json.loads((run_dir / "results.json").read_text())
    cfg = validate(data["config"])
    shared = dict(load_saved(run_dir / "final_shared.pt", "measure a finished run")["arrays"])
    global_ctx = torch.as_tensor(shared[GLOBAL_CTX] if GLOBAL_CTX in shared else shared[CTX])
    bundle = load_clip(cfg.clip.model, cfg.clip.pretrained, cfg.cache_path, cfg.device)
    rows = []
    for n in trained_nodes(data):
        node = node_data(cfg, {PARTITION_ID: int(n["partition_id"]), NUM_PARTITIONS: int(n["num_partitions"])})
        if node.part.neighbor is None:
            raise SystemExit(f"{run_dir}: a split without neighbour classes (run it with partitioner=pathological)")
        scorer = PromptScorer(bundle, node.splits.classnames, cfg)
        records = node.part.neighbor
        feats = scorer.image_features(node.splits.test, records, cfg.cache_path)
        labels = node.splits.test.labels[records]
        personal = torch.load(run_dir / "published" / f"{n['name']}.pt", weights_only=False)["prompts"]
        if CTX not in personal:
            raise SystemExit(
                f"{run_dir}: {cfg.method} does not score with one context (FedOTP, pFedMoAP): not measured"
            )
        acc_p, own_p = shares(scorer.logits(personal, feats), labels, node.part.classes)
        acc_g, own_g = shares(scorer.logits({CTX: global_ctx}, feats), labels, node.part.classes)
        rows.append(
            {
                "node": n["name"],
                "own classes": len(node.part.classes),
                "chance share": len(node.part.classes) / node.splits.n_classes,
                "personal": {"neighbor-acc": acc_p, "own-share": own_p},
                "global": {"neighbor-acc": acc_g, "own-share": own_g},
            }
        )
    mean = {
        f"{which}-{k}": float(np.mean([r[which][k] for r in rows]))
        for which in ("personal", "global")
        for k in ("neighbor-acc", "own-share")
    }
    mean["chance share"] = float(np.mean([r["chance share"] for r in rows]))
    return {"run": run_dir.name, "method": cfg.method, "mean": mean, "nodes": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    found = []
    for run_dir in args.runs:
        r = one_run(run_dir)
        found.append(r)
        m = r["mean"]
        print(
            f"{r['run']}: personal neighbour acc {100 * m['personal-neighbor-acc']:.1f}% (own-class share "
            f"{100 * m['personal-own-share']:.1f}%), global alone {100 * m['global-neighbor-acc']:.1f}% (own-class "
            f"share {100 * m['global-own-share']:.1f}%); chance share {100 * m['chance share']:.1f}%",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(bench_report({"runs": found}), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
