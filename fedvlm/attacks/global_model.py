"""Membership inference against the model a Reprogrammable-FL run publishes: its final global
model (the source network, the shared program or fine-tuned weights of ``final_shared.pt``).

Its clients keep nothing private (every trainable tensor is averaged), so what an outsider gets
is that one model. The question asked of it: was record x in some client's training set?
Members are every training record of the clients that trained; non-members, the test records,
which no client trained on and which come from the same distribution. Two scores, both needing
nothing but the published model and the run's seeded initial model (which every participant can
rebuild from the config):

- ``global-loss``: the record's loss under the final model, lower for members (Yeom et al.,
  2018, the loss-threshold attack);
- ``global-calibrated``: the loss the training removed, initial minus final, which discounts
  records that are easy or hard for any model (the difficulty calibration of Watson et al., 2022).

Each pools every client's members and non-members into one ROC: AUC and TPR at 1% and 0.1% FPR
with bootstrap 95% intervals (``likelihood.bootstrap``). A DP-SGD run bounds what either can
achieve by its accounted epsilon; at the family's z = 1.1 both sit at chance, and the same
attack on a run without noise is what shows they can find members at all
(``tests/integration/test_reprogram.py``).

    python -m fedvlm.attacks.global_model RUN_DIR      # writes RUN_DIR/global_attack.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.attacks.likelihood import bootstrap
from fedvlm.attacks.reports import ATTACKED, GLOBAL, global_pooled
from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
from fedvlm.spec import spec_of
from fedvlm.strategies.records import TRAIN_ROW
from fedvlm.utils.files import UnreadableFile, atomic_write_json, load_saved, read_results

BATCH = 256


@torch.no_grad()
def record_losses(model: torch.nn.Module, source, rows: np.ndarray, size: int) -> np.ndarray:
    """Cross-entropy of each record ``rows`` of ``source`` under ``model`` (images resized as the
    clients resize them)."""
    from fedvlm.client_app.reprogram_clients import resized

    model.eval()
    out = []
    for start in range(0, len(rows), BATCH):
        picked = rows[start : start + BATCH]
        x = torch.stack([resized(source, int(i), size) for i in picked]).float().div_(255.0)
        y = torch.from_numpy(source.labels[picked])
        out.append(F.cross_entropy(model(x), y, reduction="none").numpy())
    return np.concatenate(out) if out else np.zeros(0)


def _trained(figures: dict) -> bool:
    return any(k.startswith(TRAIN_ROW) for k in figures)


def trained_nodes(data: dict) -> list[dict]:
    """The run's nodes that trained in some round (their records are the members)."""
    trained = {name for r in data["rounds"] for name, m in r.get("clients", {}).items() if _trained(m)}
    return [n for n in data["run"]["nodes"] if n["name"] in trained and int(n.get("partition_id", -1)) >= 0]


def run_attack(run_dir: Path) -> dict:
    """Attack a finished run's global model; the report (also written to ``GLOBAL``)."""
    from fedvlm.methods.validation import validate
    from fedvlm.models.reprogram import initial_model, input_size, source_model

    run_dir = Path(run_dir)
    data = read_results(run_dir, ATTACKED)
    cfg = validate(data["config"])
    nodes = trained_nodes(data)
    if not nodes:
        raise ValueError(f"{run_dir}: no simulated node trained in this run, so there is no member to look for")
    shared = dict(load_saved(run_dir / "final_shared.pt", "run the attack on a finished run")["arrays"])
    spec = spec_of(cfg)
    family = spec.family
    datas = [
        family.node_data(cfg, {PARTITION_ID: int(n["partition_id"]), NUM_PARTITIONS: int(n["num_partitions"])})
        for n in nodes
    ]
    splits = datas[0].splits  # one dataset split over the simulated nodes
    members = np.unique(np.concatenate([d.part.train for d in datas]))
    nonmembers = np.arange(len(splits.test))
    initial = initial_model(cfg, spec.model_kind, splits.n_classes)
    final = initial_model(cfg, spec.model_kind, splits.n_classes)
    params = dict(final.named_parameters())
    with torch.no_grad():
        for k, v in shared.items():
            params[k].copy_(torch.as_tensor(v, dtype=params[k].dtype))
    size = input_size(spec.model_kind, source_model(cfg), cfg.reprogram.image_size)
    loss = {
        (split, which): record_losses(model, source, rows, size)
        for split, source, rows in (("in", splits.train, members), ("out", splits.test, nonmembers))
        for which, model in (("initial", initial), ("final", final))
    }
    member = np.r_[np.ones(len(members), bool), np.zeros(len(nonmembers), bool)]
    scores = {
        "global-loss": -np.r_[loss["in", "final"], loss["out", "final"]],
        "global-calibrated": np.r_[
            loss["in", "initial"] - loss["in", "final"], loss["out", "initial"] - loss["out", "final"]
        ],
    }
    report = {
        "run": run_dir.name,
        "method": cfg.method,
        "members": int(len(members)),
        "nonmembers": int(len(nonmembers)),
        "nodes": [n["name"] for n in nodes],
        "mean_loss": {f"{split}-{which}": float(v.mean()) for (split, which), v in loss.items()},
        "attacks": {name: {"pooled": bootstrap(s, member)} for name, s in scores.items()},
    }
    atomic_write_json(report, run_dir / GLOBAL)
    return report


def pooled_attacks(run_dir: Path, shadows: int = 0, online: int = 0) -> dict[str, dict]:
    """The reprogramming family's membership attacks on a finished run
    (``Family.membership_attack``): the pooled ones of its global_attack.json, attacking first
    where the folder has none. They need no shadow or reference federations (``shadows`` and
    ``online`` are the prompt family's knobs): the run's own initial model calibrates them."""
    path = Path(run_dir) / GLOBAL
    report = json.loads(path.read_text()) if path.exists() else run_attack(Path(run_dir))
    return global_pooled(report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.attacks.global_model", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    args = p.parse_args(argv)
    try:
        report = run_attack(args.run_dir)
    except UnreadableFile as err:  # the run's own file: named, with what to do
        p.error(str(err))
    for name, attack in report["attacks"].items():
        pooled = attack["pooled"]
        print(
            f"{name}: AUC {pooled['auc']['value']:.3f} {pooled['auc']['ci95']}, "
            f"TPR@0.1%FPR {pooled['tpr@0.1%fpr']['value']:.4f} "
            f"({report['members']} members, {report['nonmembers']} non-members)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
