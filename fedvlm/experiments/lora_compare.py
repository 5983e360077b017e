"""FedRand against its baselines: the same VLM task, rounds and seed for every LoRA method, then
the MaxRényi-K% membership attack on each run; writes a table (Markdown and CSV) and a plot.

    python -m fedvlm.experiments.lora_compare --out ~/fedvlm-lora                     # embedded captions
    python -m fedvlm.experiments.lora_compare --set dataset=embedded-vqa --rounds 10
    python -m fedvlm.experiments.lora_compare --methods fedavg-lora,fedrand --epsilons none,8,1
    python -m fedvlm.experiments.lora_compare --set vlm.model=HuggingFaceTB/SmolVLM-256M-Instruct \\
        dataset=coco-captions data-root=/data/coco --rounds 50 --clients 10

Columns: the last round's server-model and mean client-model metrics (CIDEr and BLEU-4 for
captions, exact match for VQA; the server model also on the out-of-domain split), training
traffic against full LoRA, and the attack's best AUROC over (alpha, K) against the server model
and against the client models the server can rebuild. ``table_attacks.md/.csv`` holds
MaxRényi-10% (alpha 0.5, fixed in advance) on the server's model and on the rebuilt client
models, and the base-model-calibrated likelihood and RMIA on the client models, pooled over
clients with bootstrap 95% intervals (with ``--set attack.observe-uploads=true`` also the server's
attacks on every upload, ``uploads-*``), and ``attack_tpr_vs_epsilon.png`` its TPR at 1% and 0.1%
FPR against the accounted epsilon (``--epsilons``). Finished runs are reused.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from pathlib import Path

from fedvlm.attacks.reports import MAXRENYI, maxrenyi_pooled
from fedvlm.experiments.attack_report import attack_row, plot_attacks, write_attack_table
from fedvlm.experiments.sweep import DAMAGED, run_one
from fedvlm.experiments.sweep_report import SPENT
from fedvlm.methods.registry import VLM, methods_of
from fedvlm.metrics import CLIENT_MODEL, OOD, SERVER_MODEL, TASK_LOSS, VLM_MODELS, VQA_SCORES, vlm_score
from fedvlm.runconfig import parse_value
from fedvlm.utils.files import RESULTS, atomic_savefig, atomic_write_csv, atomic_write_text, read_results

METHODS = tuple(m.name for m in methods_of(VLM))
BOUNDS = ("-lo", "-hi")  # interval attacks go to table_attacks, not the main table


def _best(threat: dict | None) -> tuple[float, str] | None:
    """Highest AUROC over the (alpha, K) grid, with its setting; the attacker picks the best."""
    if not threat or "skipped" in threat:
        return None
    grid = threat.get("mean", threat)
    scored = [(v["auroc"], k) for k, v in grid.items() if k.startswith("alpha=")]
    return max(scored) if scored else None


def summarise(method: str, data: dict, mia: dict | None) -> dict:
    last = data["rounds"][-1]["metrics"]
    comm = data.get("communication", {})
    vqa = any(vlm_score(who, score) in last for who in VLM_MODELS for score in VQA_SCORES)
    row = {
        "method": method,
        "rounds": len(data["rounds"]),
        "task": "vqa" if vqa else "captions",
        **{vlm_score(who, TASK_LOSS): last.get(vlm_score(who, TASK_LOSS)) for who in (CLIENT_MODEL, SERVER_MODEL)},
    }
    scores = VQA_SCORES if vqa else ("cider", "bleu-4", "rouge-l")
    for who in (*VLM_MODELS, OOD):
        for score in scores:
            if vlm_score(who, score) in last:
                row[vlm_score(who, score)] = last[vlm_score(who, score)]
    row["up-vs-full-lora"] = comm.get("up_vs_full_lora")
    row["down-vs-full-lora"] = comm.get("down_vs_full_lora")
    row["seconds"] = round(sum(r["seconds"] for r in data["rounds"]), 1)
    spent = (data.get("privacy", {}).get("rounds") or [{}])[-1]
    row[SPENT] = spent.get("epsilon")
    if mia:
        for threat in ("server", "client"):
            best = _best(mia["threats"].get(threat))
            row[f"mia-{threat}-auroc"] = best[0] if best else None
            row[f"mia-{threat}-setting"] = best[1] if best else "n/a"
        # the setting fixed in advance, with intervals: the server's model, the clients' pooled
        row.update(attack_row(maxrenyi_pooled(mia)))
    return row


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_table(rows: list[dict], out: Path) -> None:
    every = list(dict.fromkeys(k for r in rows for k in r))
    cols = [c for c in every if not c.endswith(BOUNDS) and f"{c}-lo" not in every]  # attacks: table_attacks
    atomic_write_csv([cols, *([r.get(c, "") for c in cols] for r in rows)], out / "lora_compare.csv")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    atomic_write_text("\n".join(lines) + "\n", out / "lora_compare.md")


def plot(runs: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, data in runs.items():
        last = data["rounds"][-1]["metrics"]
        shown = (
            vlm_score(SERVER_MODEL, "cider"),
            vlm_score(SERVER_MODEL, "accuracy"),
            vlm_score(CLIENT_MODEL, TASK_LOSS),
        )
        key = next((k for k in shown if k in last), None)
        if key is None:
            continue
        shown_rounds = [r for r in data["rounds"] if key in r["metrics"]]  # the evaluated ones (evaluate-every)
        ax.plot([r["round"] for r in shown_rounds], [r["metrics"][key] for r in shown_rounds], marker="o", label=label)
        ax.set_ylabel(key)
    ax.set_xlabel("round")
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, out / "lora_compare.png", 120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.experiments.lora_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("~/fedvlm-lora").expanduser())
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--epsilons", default="none", help="comma-separated target epsilons ('none' = no DP), each method at each"
    )
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config overrides for every run")
    p.add_argument("--engine", choices=("inprocess", "flwr"), default="inprocess")
    p.add_argument(
        "--mia-samples", type=int, default=100, help="members and non-members per attacked model (0 = no attack)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = args.out.expanduser()
    out.mkdir(parents=True, exist_ok=True)
    base = {"dataset": "embedded-captions", "num-server-rounds": args.rounds, "output-dir": str(out / "runs")}
    for item in args.set:
        k, v = item.split("=", 1)
        base[k] = parse_value(v)
    runs, rows = {}, []
    methods = [m for m in args.methods.split(",") if m]
    for method, eps in itertools.product(methods, [e for e in args.epsilons.split(",") if e]):
        name = method if eps == "none" else f"{method}-eps{eps}"
        raw = {**base, "method": method, "run-name": name}
        if eps != "none":
            raw["privacy.epsilon"] = float(eps)
        t0 = time.time()
        data = read_results(out / "runs" / name, DAMAGED) if (out / "runs" / name / RESULTS).exists() else None
        if data is None or data["run"].get("status") != "finished":
            data = run_one(raw, args.clients, args.engine, out)
        mia = None
        if args.mia_samples:
            from fedvlm.attacks.maxrenyi import run_maxrenyi

            report = out / "runs" / name / MAXRENYI
            mia = (
                json.loads(report.read_text())
                if report.exists()
                else run_maxrenyi(out / "runs" / name, args.mia_samples)
            )
        runs[name] = data
        rows.append({**summarise(method, data, mia), "epsilon": eps})
        print(
            f"{name}: "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in rows[-1].items() if k != "method" and not k.endswith(BOUNDS))
            + f" ({time.time() - t0:.0f}s)",
            flush=True,
        )
        write_table(rows, out)
        write_attack_table(rows, out, "the VLM models", keys=("method", "epsilon"))
    plot(runs, out)
    plot_attacks(rows, out, series="method")
    print(f"tables: {out / 'lora_compare.md'}, {out / 'lora_compare.csv'}; plot: {out / 'lora_compare.png'}")
    if (out / "table_attacks.md").exists():
        print((out / "table_attacks.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
