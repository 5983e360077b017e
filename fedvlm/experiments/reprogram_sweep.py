"""Reprogrammable-FL's experiments: accuracy against the privacy spent, for every method and
source model, written like the paper's Figure 3 (accuracy vs epsilon after every 10 rounds) and
Table I (accuracy at a fixed epsilon).

    python -m fedvlm.experiments.reprogram_sweep --out ~/fedvlm-reprogram                 # embedded, minutes
    python -m fedvlm.experiments.reprogram_sweep --set dataset=cifar10 data-root=/data download=true \\
        --sources resnet18,resnet50 --rounds 100 --epsilon 1.04                         # the paper's CIFAR-10
    python -m fedvlm.experiments.reprogram_sweep --set partitioner=quantity-skew quantity-ratios=45:9:1 ...

Every run is a federation of ``--clients`` clients (3 in the paper) with the run config's
DP-SGD (C = 1, z = 1.1, Poisson batches, lr 0.15, L local iterations). Per round the server's
ledger gives epsilon (the worst client's, dp-accounting RDP by default) and the clients' test
accuracy of the global model (weighted by test size: the global model on the union of test
sets). Writes ``curves.csv`` (every round), ``figure3.png`` (points every 10 rounds),
``table_at_epsilon.md``/``.csv`` (accuracy at the last round whose epsilon is within the target,
mean ± std over seeds). Finished runs are reused.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from pathlib import Path

from fedvlm.experiments import stats
from fedvlm.experiments.sweep import DAMAGED, run_one, whole_numbers
from fedvlm.methods.registry import REPROGRAM, methods_of
from fedvlm.metrics import ACC, ACC_WEIGHTED
from fedvlm.runconfig import parse_value
from fedvlm.utils.files import RESULTS, atomic_savefig, read_results

METHODS = tuple(m.name for m in methods_of(REPROGRAM))


def curve(data: dict) -> list[dict]:
    """Per evaluated round (every round, unless ``evaluate-every`` says otherwise): epsilon spent
    (worst client) and the global model's test accuracy."""
    eps = {e["round"]: e["epsilon"] for e in data.get("privacy", {}).get("rounds", [])}
    out = []
    for r in data["rounds"]:
        m = r["metrics"]
        acc = m.get(ACC_WEIGHTED["local"], m.get(ACC["local"]))
        if acc is not None:
            out.append({"round": r["round"], "epsilon": eps.get(r["round"], 0.0), "accuracy": acc})
    return out


def at_epsilon(points: list[dict], target: float) -> float | None:
    """Accuracy at the last round whose epsilon is within ``target``."""
    ok = [p for p in points if p["epsilon"] <= target * (1 + 1e-9)]
    return ok[-1]["accuracy"] if ok else None


def plot(curves: dict[tuple, list[dict]], out: Path, every: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = sorted({k[0] for k in curves})
    fig, axes = plt.subplots(1, len(sources), figsize=(5 * len(sources), 4), squeeze=False)
    for ax, source in zip(axes[0], sources, strict=True):
        for (src, method, seed), pts in sorted(curves.items()):
            if src != source or seed != min(k[2] for k in curves if k[:2] == (src, method)):
                continue
            shown = [p for p in pts if p["round"] % every == 0 or p is pts[-1]]
            ax.plot([p["epsilon"] for p in shown], [100 * p["accuracy"] for p in shown], marker="o", label=method)
        ax.set_title(f"source: {source}")
        ax.set_xlabel("epsilon")
        ax.set_ylabel("test accuracy (%)")
        ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, out / "figure3.png", 120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedvlm.experiments.reprogram_sweep", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("~/fedvlm-reprogram").expanduser())
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--sources", default="auto", help="comma-separated reprogram.source-model values")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--seeds", type=whole_numbers, default="0")
    p.add_argument(
        "--epsilon",
        type=float,
        default=0.0,
        help="Table I's fixed epsilon (0 = the smallest final epsilon over the runs, so every method has a value)",
    )
    p.add_argument("--every", type=int, default=10, help="plot a point every this many rounds")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config overrides for every run")
    p.add_argument("--engine", choices=("inprocess", "flwr"), default="inprocess")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = args.out.expanduser()
    out.mkdir(parents=True, exist_ok=True)
    base = {"num-server-rounds": args.rounds, "output-dir": str(out / "runs")}
    for item in args.set:
        k, v = item.split("=", 1)
        base[k] = parse_value(v)
    curves: dict[tuple, list[dict]] = {}
    for source in args.sources.split(","):
        for method in args.methods.split(","):
            for seed in args.seeds:
                name = f"{method}-{source}-seed{seed}"
                raw = {**base, "method": method, "reprogram.source-model": source, "seed": seed, "run-name": name}
                found = (out / "runs" / name / RESULTS).exists()
                data = read_results(out / "runs" / name, DAMAGED) if found else None
                if data is None or data["run"].get("status") != "finished":
                    data = run_one(raw, args.clients, args.engine, out)
                resolved = data["config"]["reprogram.source-model"]
                curves[(resolved, method, seed)] = pts = curve(data)
                print(
                    f"{name}: epsilon {pts[-1]['epsilon']:.3g}, accuracy {100 * pts[-1]['accuracy']:.2f}%", flush=True
                )
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["source", "method", "seed", "round", "epsilon", "accuracy"])
        for (src, method, seed), pts in sorted(curves.items()):
            for pt in pts:
                w.writerow([src, method, seed, pt["round"], pt["epsilon"], pt["accuracy"]])
    target = args.epsilon or min(pts[-1]["epsilon"] for pts in curves.values())
    sources = sorted({k[0] for k in curves})
    methods = [m for m in args.methods.split(",")]
    table = [["method"] + sources]
    for method in methods:
        row = [method]
        for src in sources:
            found = [at_epsilon(pts, target) for (s, m, _), pts in curves.items() if s == src and m == method]
            figure = stats.spread(found)
            row.append("-" if figure is None else figure.text(100.0))
        table.append(row)
    with open(out / "table_at_epsilon.csv", "w", newline="") as f:
        csv.writer(f).writerows(table)
    md = [
        f"Test accuracy (%) at epsilon = {target:.3g} (delta from the run config), mean ± std over seeds",
        "",
        "| " + " | ".join(table[0]) + " |",
        "|" + "---|" * len(table[0]),
    ]
    md += ["| " + " | ".join(r) + " |" for r in table[1:]]
    (out / "table_at_epsilon.md").write_text("\n".join(md) + "\n")
    plot(curves, out, args.every)
    print("\n".join(md))
    print(f"curves: {out / 'curves.csv'}; figure: {out / 'figure3.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
