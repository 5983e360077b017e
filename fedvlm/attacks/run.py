"""Run the membership-inference attacks against a finished run folder.

    python -m fedvlm.attacks <run-dir> [--shadows 2] [--per-class] [--shadow-data-root DIR]

Reads the run's results.json (its validated config) and the prompts its clients published,
trains shadow federations like the target on disjoint shadow data (the embedded task's
independent draw, or an image folder you supply), and writes ``mia.json`` into the run
folder: Shokri and loss-threshold attack accuracy, AUC and TPR at 1% FPR; offline LiRA and RMIA
(the shadow federations' clients of the same partition as reference models) with AUC and TPR at
0.1% and 1% FPR, each with a bootstrap 95% interval, per client and pooled.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from fedvlm.attacks.membership import (
    REFERENCE_ATTACKS,
    ShadowAttack,
    client_records,
    evaluate_reference_attacks,
    load_published,
)
from fedvlm.methods.registry import get_method, validate
from fedvlm.utils.files import atomic_write_json

log = logging.getLogger(__name__)


def shadow_config(target_cfg: dict, shadow_index: int, out_dir: Path, shadow_data_root: str | None) -> dict:
    cfg = dict(target_cfg)
    if shadow_data_root:
        cfg.update({"dataset": "image-folder", "data-root": str(Path(shadow_data_root).resolve())})
    elif cfg["dataset"] == "embedded":
        cfg.update({"dataset": "embedded-shadow"})
    else:
        raise ValueError(
            f"shadow models need data disjoint from the target's; dataset {cfg['dataset']!r} has no built-in "
            "shadow split: pass --shadow-data-root with an image folder from the same distribution"
        )
    cfg.update(
        {
            "seed": int(cfg["seed"]) + 1000 + shadow_index,
            "output-dir": str(out_dir),
            "run-name": f"shadow-{shadow_index}",
            "privacy.max-epsilon": 0.0,
        }
    )
    return cfg


def run_attacks(
    run_dir: Path, shadows: int = 2, per_class: bool = False, shadow_data_root: str | None = None, seed: int = 0
) -> dict:
    from fedvlm.client_app.app import app as client_app
    from fedvlm.server_app.app import execute
    from fedvlm.utils.inprocess import InProcessGrid

    run_dir = Path(run_dir)
    data = json.loads((run_dir / "results.json").read_text())
    cfg = validate(data["config"])
    published = load_published(run_dir / "published")
    sim = {k: v for k, v in published.items() if v["partition_id"] >= 0}
    if not sim:
        raise FileNotFoundError(f"no published prompts of simulated clients under {run_dir / 'published'}")
    n = len([nd for nd in data["run"]["nodes"] if nd["partition_id"] >= 0])
    t0 = time.time()
    targets = [client_records(cfg, pub, n, seed) for pub in sim.values()]
    shadow_records = []
    # LiRA/RMIA references: the target clients' records under each shadow federation's client of
    # the same partition (same classes, never trained on these records)
    references: dict[str, list] = {pub["node"]: [] for pub in sim.values()}
    with tempfile.TemporaryDirectory() as tmp:
        for s in range(shadows):
            scfg = validate(shadow_config(cfg.as_dict(), s, Path(tmp), shadow_data_root))
            grid = InProcessGrid(
                client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], scfg.as_dict()
            )
            log.info("training shadow federation %d/%d", s + 1, shadows)
            with contextlib.redirect_stdout(io.StringIO()):
                rec = execute(scfg, grid, run_id=f"shadow-{s}")
            shadow_pubs = {p["partition_id"]: p for p in load_published(rec.dir / "published").values()}
            for pub in shadow_pubs.values():
                shadow_records.append(client_records(scfg, pub, n, seed + 1 + s))
            for pub in sim.values():
                if pub["partition_id"] in shadow_pubs:
                    references[pub["node"]].append(
                        client_records(cfg, pub, n, seed, under=shadow_pubs[pub["partition_id"]])
                    )
    attack = ShadowAttack(shadow_records, per_class, len(targets[0].probs[0]), seed)
    result = attack.evaluate(targets)
    likelihood = evaluate_reference_attacks(targets, references, seed)
    result["summary"].update(likelihood["summary"])
    for client, figures in likelihood["per_client"].items():
        result["per_client"][client].update(figures)
    result.update(
        {
            "target_run": str(run_dir),
            "method": cfg.method,
            "privacy": data.get("privacy", {}).get("settings"),
            "epsilon_spent": (data.get("privacy", {}).get("rounds") or [{}])[-1],
            "shadows": {
                "federations": shadows,
                "clients": len(shadow_records),
                "dataset": "image-folder" if shadow_data_root else f"{cfg.dataset}-shadow",
            },
            "attack_model": "per-class MLPs (Shokri)" if per_class else "pooled MLP on class-aligned log-probabilities",
            "records_per_target_client": int(len(targets[0].member)),
            "seconds": round(time.time() - t0, 1),
        }
    )
    atomic_write_json(result, run_dir / "mia.json")
    return result


def _interval(metric: dict, digits: int) -> str:
    low, high = metric["ci95"]
    return f"{metric['value']:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.attacks", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--shadows", type=int, default=2, help="shadow federations to train (default 2)")
    p.add_argument("--per-class", action="store_true", help="one attack model per class (Shokri) instead of pooled")
    p.add_argument("--shadow-data-root", help="image folder of shadow data (needed for non-embedded datasets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=300, help="VLM runs: members and non-members per attacked model")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    method = get_method(json.loads((args.run_dir / "results.json").read_text())["run"]["method"])
    if method.adapter:  # FedRand and its LoRA baselines: the MaxRényi-K% attack (attacks.maxrenyi)
        from fedvlm.attacks.maxrenyi import main as maxrenyi_main

        return maxrenyi_main([str(args.run_dir), "--samples", str(args.samples), "--seed", str(args.seed)])
    res = run_attacks(args.run_dir, args.shadows, args.per_class, args.shadow_data_root, args.seed)
    s = res["summary"]
    print(
        f"membership inference on {res['method']} ({res['records_per_target_client']} records per client, "
        f"chance = 50%):"
    )
    for name in ("shokri", "loss-threshold"):
        print(
            f"  {name:15s} accuracy {100 * s[name]['accuracy']:.1f}%  AUC {s[name]['auc']:.3f}  "
            f"TPR@1%FPR {100 * s[name]['tpr@1%fpr']:.1f}%"
        )
    for name in REFERENCE_ATTACKS:
        pooled = s[name]["pooled"]
        print(
            f"  {name:15s} pooled AUC {_interval(pooled['auc'], 3)}  TPR@1%FPR {_interval(pooled['tpr@1%fpr'], 3)}  "
            f"TPR@0.1%FPR {_interval(pooled['tpr@0.1%fpr'], 3)}"
        )
    print(f"written: {args.run_dir / 'mia.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
