"""Sweep methods x epsilon x seeds (and DP-FPL's rank and residual) and write DP-FPL's tables.

    python -m fedvlm.experiments.sweep --out ~/fedvlm-sweeps/embedded               # the embedded default
    python -m fedvlm.experiments.sweep --methods dpfpl --ranks 1,2,4,8 --residual on,off --epsilons none,0.1
    python -m fedvlm.experiments.sweep --preset paper-caltech101 --set data-root=/data/caltech --seeds 0,1,2
    python -m fedvlm.experiments.sweep ... --mia                                     # also attack every run
    python -m fedvlm.experiments.sweep --methods dpfpl --epsilons 1,8 --audit 100     # audit every private run
    python -m fedvlm.experiments.sweep --compare pfedmoap --epsilons none            # pFedMoAP's comparison set
    python -m fedvlm.experiments.sweep --compare pfedmoap --preset paper-pfedmoap-dtd --set data-root=/data
    python -m fedvlm.experiments.sweep --variant prox promptfl prompt.fedprox-mu=0.1  # any labelled variant

Every run is a full federation through the real strategies and ClientApp (in-process by
default; ``--engine flwr`` runs each one through ``flwr run``). Finished runs are reused, so
an interrupted sweep resumes. Outputs in ``--out``:
- ``runs/<name>/``: each run's folder (results.json, plots, published prompts, mia.json);
- ``summary.csv``: one row per run (method, variant, epsilon, seed, metrics, epsilon spent);
- ``table_local.md/.csv``, ``table_neighbor.md/.csv``: mean of the last 10 rounds, mean ± std
  over seeds, methods x epsilon (DP-FPL's Tables 2 and 3), and ``table_mia.md`` with ``--mia``;
- ``table_final.md/.csv``: local accuracy after the last round (pFedMoAP's protocol), with the
  paper's number beside ours when the preset has one;
- ``accuracy_vs_epsilon.png`` (``accuracy_by_variant.png`` when only 'none' ran) and, with
  ``--mia``, ``mia_vs_epsilon.png``, ``table_attacks.md/.csv`` (LiRA and RMIA, pooled, with
  bootstrap intervals; online LiRA with ``--online R``) and ``attack_tpr_vs_epsilon.png`` (their
  TPR at 1% and 0.1% FPR against the accounted epsilon);
- with ``--audit M``: ``table_audit.md/.csv`` and ``audit_vs_accounted.png``, every private run
  audited with M canaries (``privacy.audit-canaries``), its lower bound beside the accounted epsilon.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fedvlm.experiments.attack_report import attack_row, plot_attacks, write_attack_table
from fedvlm.methods.registry import PROMPT, get_method, methods_of, validate
from fedvlm.runconfig import KEY_BY_NAME, ConfigError, parse_value

log = logging.getLogger("sweep")

# The paper's setups (DP-FPL, Table 5 and appendix A.2). They reproduce the paper's protocol,
# including its noise calibration and per-batch clipping, so its epsilon claims do NOT hold
# for them (the ledger says so); add --set privacy.calibration=accountant
# privacy.clipping=per-sample for runs whose epsilon does hold.
_PAPER = {
    "clip.pretrained": "openai",
    "partitioner": "pathological",
    "num-server-rounds": 100,
    "prompt.batch-size": 32,
    "prompt.optimizer": "sgd",
    "prompt.lr": 1e-4,
    "prompt.momentum": 0.0,
    "dpfpl.server-optimizer": "sgd",
    "dpfpl.server-lr": 1e-4,
    "prompt.local-steps": 1,
    "privacy.clip": 10.0,
    "privacy.delta": 1e-5,
    "privacy.calibration": "paper",
    "privacy.clipping": "per-batch",
    "prompt.n-ctx": 16,
}
PRESETS: dict[str, dict] = {
    **{
        f"paper-{d}": {**_PAPER, "dataset": d, "clip.model": "ViT-B-16"}
        for d in ("caltech101", "oxford-pets", "flowers102", "food101")
    },
    **{
        f"paper-cifar100-{n}": {
            **_PAPER,
            "dataset": "cifar100",
            "clip.model": "RN50",
            "partitioner": "dirichlet",
            "dirichlet-alpha": 0.3,
            "num-server-rounds": 200,
            "_clients": n,
        }
        for n in (25, 50)
    },
}

# pFedMoAP's setups (its Table 1 and appendix; METHODS.md "pFedMoAP"): RN50, 16 shots, 10 clients
# with disjoint classes, every client every round, 10 rounds of 5 local epochs, CoOp's SGD. The
# slides do not give CIFAR's round count; 50 is this project's choice (10% sampling: each client
# trains about 5 times).
_MOAP = {
    "clip.model": "RN50",
    "clip.pretrained": "openai",
    "partitioner": "pathological",
    "max-per-class": 16,
    "fraction-train": 1.0,
    "num-server-rounds": 10,
    "prompt.local-epochs": 5,
    "prompt.optimizer": "sgd",
    "prompt.lr": 0.002,
    "prompt.momentum": 0.9,
    "prompt.weight-decay": 5e-4,
    "prompt.batch-size": 32,
    "prompt.n-ctx": 16,
}
# The paper's local accuracy (%), keyed by (variant label of COMPARISONS["pfedmoap"], epsilon).
_MOAP_ORDER = ("zeroshot", "coop", "promptfl", "promptfl+fedprox", "fedotp", "pfedmoap-lambda0", "pfedmoap")
_MOAP_TABLE1 = {
    "flowers102": (62.17, 70.14, 72.80, 66.40, 96.23, 97.61, 98.41),
    "oxford-pets": (84.47, 83.21, 90.79, 89.24, 98.82, 94.83, 99.06),
    "food101": (75.27, 70.43, 77.31, 76.24, 92.73, 86.71, 93.39),
    "caltech101": (85.14, 87.37, 89.70, 89.41, 97.02, 95.71, 97.95),
    "dtd": (40.21, 44.23, 54.11, 44.26, 87.64, 85.64, 89.13),
}
_MOAP_TABLE6 = {  # (epsilon, variant): Flowers102, OxfordPets, Food101, Caltech101, DTD
    ("50", "promptfl"): (67.07, 88.05, 77.41, 84.83, 38.39),
    ("50", "promptfl+fedprox"): (66.22, 87.78, 77.27, 84.68, 39.43),
    ("50", "pfedmoap"): (98.34, 99.08, 93.36, 97.90, 89.99),
    ("25", "promptfl"): (64.25, 86.26, 76.84, 85.00, 38.19),
    ("25", "promptfl+fedprox"): (62.87, 86.82, 76.21, 84.51, 37.82),
    ("25", "pfedmoap"): (98.36, 99.02, 93.41, 97.99, 89.11),
}
_MOAP_CIFAR = {  # zeroshot, coop, promptfl, promptfl+fedprox, pfedmoap (lambda 0.5)
    "cifar10": (53.46, 80.84, 73.29, 73.32, 83.46),
    "cifar100": (32.68, 48.74, 45.00, 45.63, 53.42),
}
for _i, _d in enumerate(_MOAP_TABLE1):
    PRESETS[f"paper-pfedmoap-{_d}"] = {
        **_MOAP,
        "dataset": _d,
        "_reference": {
            **{(v, "none"): acc for v, acc in zip(_MOAP_ORDER, _MOAP_TABLE1[_d], strict=True)},
            **{(v, e): accs[_i] for (e, v), accs in _MOAP_TABLE6.items()},
        },
    }
for _d, _accs in _MOAP_CIFAR.items():
    PRESETS[f"paper-pfedmoap-{_d}"] = {
        **_MOAP,
        "dataset": _d,
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.5,
        "max-per-class": 0,
        "fraction-train": 0.1,
        "num-server-rounds": 50,
        "_clients": 100,
        "_reference": {
            (v, "none"): acc
            for v, acc in zip(("zeroshot", "coop", "promptfl", "promptfl+fedprox", "pfedmoap"), _accs, strict=True)
        },
    }

# Named comparison sets: (label, method, overrides). pFedMoAP's (its Table 1): every method trains
# the preset's local epochs (FedOTP's default of one step per round, DP-FPL's protocol, is lifted);
# FedProx's mu 0.01 is this project's choice (the paper does not state it).
COMPARISONS: dict[str, list[tuple[str, str, dict]]] = {
    "pfedmoap": [
        ("zeroshot", "zeroshot", {}),
        ("coop", "coop", {}),
        ("promptfl", "promptfl", {}),
        ("promptfl+fedprox", "promptfl", {"prompt.fedprox-mu": 0.01}),
        ("fedotp", "fedotp", {"prompt.local-steps": 0}),
        ("pfedmoap-lambda0", "pfedmoap", {"pfedmoap.lambda": 0.0}),
        ("pfedmoap", "pfedmoap", {}),
    ],
}
EPSILONS = ("none", "0.4", "0.2", "0.1", "0.05", "0.01")


def run_one(raw: dict, clients: int, engine: str, out: Path) -> dict:
    """Run one config; returns its results.json content."""

    cfg = validate(raw)
    if engine == "inprocess":
        from fedvlm.client_app.app import app as client_app
        from fedvlm.server_app.app import execute
        from fedvlm.utils.inprocess import InProcessGrid

        grid = InProcessGrid(
            client_app, [{"partition-id": i, "num-partitions": clients} for i in range(clients)], cfg.as_dict()
        )
        with contextlib.redirect_stdout(io.StringIO()):
            return execute(cfg, grid, run_id=raw["run-name"]).data
    from fedvlm.utils.processes import flwr_env, flwr_run, kill_tree, pids_matching

    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = flwr_run(flwr_env(Path(tmp)), raw, clients, timeout=6 * 3600)
        finally:
            for pid in pids_matching(tmp):
                kill_tree(pid)
    results = Path(raw["output-dir"]) / raw["run-name"] / "results.json"
    if not results.exists():
        log_tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"flwr run of {raw['run-name']} wrote no results.json; its output ends:\n{log_tail}")
    return json.loads(results.read_text())


def _variants(methods, ranks, residuals):
    """(label, method, overrides): the rank axis for every low-rank method, and the residual
    ablation for a method that has a '<method>.residual' key (DP-FPL)."""
    for m in methods:
        spec = get_method(m)
        residual_key = f"{m}.residual" if f"{m}.residual" in KEY_BY_NAME else ""
        if not spec.rank_key:
            yield m, m, {}
            continue
        for r, res in itertools.product(ranks, residuals if residual_key else [True]):
            overrides = {spec.rank_key: r, **({residual_key: res} if residual_key else {})}
            yield f"{m}-r{r}" + ("" if res else "-nores"), m, overrides


def _labelled(items: list[list[str]]) -> list[tuple[str, str, dict]]:
    """--variant LABEL METHOD [KEY=VALUE ...] -> (label, method, overrides), checked now so that a
    typo fails before the first run rather than hours into a sweep."""
    out = []
    for label, method, *pairs in items:
        get_method(method)
        overrides = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in KEY_BY_NAME:
                raise SystemExit(f"--variant {label}: {pair!r} is not KEY=VALUE with a run-config key")
            overrides[key] = parse_value(value)
        out.append((label, method, overrides))
    return out


def _fmt(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return "-"
    return f"{100 * np.mean(vals):.2f} ± {100 * np.std(vals):.2f}" if len(vals) > 1 else f"{100 * vals[0]:.2f}"


def write_failures(rows: list[dict], out: Path) -> None:
    """table_failures.md: every run that could not run or did not finish, with its reason."""
    failed = [r for r in rows if r["status"] == "failed"]
    path = out / "table_failures.md"
    if not failed:
        path.unlink(missing_ok=True)
        return
    lines = ["| variant | epsilon | seed | why |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['epsilon']} | {r['seed']} | {r['error'].replace('|', '/')} |" for r in failed]
    path.write_text("Runs that failed (the sweep went on without them)\n\n" + "\n".join(lines) + "\n")


def _write_table(out: Path, tag: str, head: str, table: list[list[str]]) -> None:
    with open(out / f"table_{tag}.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(table)
    md = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    md += ["| " + " | ".join(r) + " |" for r in table[1:]]
    (out / f"table_{tag}.md").write_text(f"{head}, mean ± std over seeds\n\n" + "\n".join(md) + "\n")


def write_tables(rows: list[dict], out: Path, epsilons: list[str], reference: dict | None = None) -> None:
    """One table per metric, variants x epsilon; ``reference`` ((variant, epsilon) -> the paper's
    accuracy in %) adds a paper column beside each of ours in the final-accuracy table."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    metrics = [("local", "local-acc-last10"), ("neighbor", "neighbor-acc-last10"), ("final", "local-acc")]
    if any(r.get("mia-shokri-acc") is not None for r in rows):
        metrics += [
            ("mia", "mia-shokri-acc"),
            ("mia_auc", "mia-shokri-auc"),
            ("mia_loss", "mia-loss-acc"),
            ("mia_loss_auc", "mia-loss-auc"),
        ]
    for tag, key in metrics:
        paper = reference if tag == "final" and reference else {}
        table = [["method"] + [h for e in epsilons for h in [f"eps={e}"] + ([f"paper eps={e}"] if paper else [])]]
        for v in variants:
            cells = [v]
            for e in epsilons:
                these = [r for r in rows if r["variant"] == v and r["epsilon"] == e]
                failed = these and all(r.get("status") == "failed" for r in these)
                cells.append("failed" if failed else _fmt([r.get(key) for r in these]))
                if paper:
                    cells.append(f"{paper[(v, e)]:.2f}" if (v, e) in paper else "-")
            table.append(cells)
        what = {
            "local": "Mean of the last 10 rounds (local classes), %",
            "neighbor": "Mean of the last 10 rounds (neighbor classes), %",
            "final": "Local accuracy after the last round, %" + (" (paper: its reported number)" if paper else ""),
            "mia": "Membership inference on the published personalised prompts: Shokri MIA accuracy (chance 50)",
            "mia_auc": "Membership inference on the published personalised prompts: Shokri MIA AUC (x100, chance 50)",
            "mia_loss": "Membership inference on the published personalised prompts: loss-threshold MIA accuracy "
            "(chance 50)",
            "mia_loss_auc": "Membership inference on the published personalised prompts: loss-threshold MIA AUC "
            "(x100, chance 50)",
        }[tag]
        _write_table(out, tag, what, table)


def _bars(plt, rows: list[dict], path: Path) -> None:
    """Local and neighbor accuracy after the last round, mean over seeds, one bar pair per variant."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(variants)), 4))
    x = np.arange(len(variants))
    for i, (key, label) in enumerate((("local-acc", "local classes"), ("neighbor-acc", "neighbor classes"))):
        means = [
            100 * np.mean([r[key] for r in rows if r["variant"] == v and r.get(key) is not None] or [np.nan])
            for v in variants
        ]
        ax.bar(x + (i - 0.5) * 0.4, means, width=0.4, label=label)
    ax.set_xticks(x, variants, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("accuracy after the last round (%)")
    ax.set_ylim(0, 115)  # room for the legend above the bars
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def audit_row(data: dict) -> dict:
    """The one-run audit of a run (results.json 'audit'), for the audited node."""
    nodes = (data.get("audit") or {}).get("nodes") or {}
    if not nodes:
        return {}
    name, node = next(iter(sorted(nodes.items())))
    return {
        "audit-node": name,
        "audit-canaries": node["canaries"],
        "audit-guesses": node["guesses"],
        "audit-correct": node["correct"],
        "audit-epsilon-lower": node["epsilon_lower"],
        "audit-accounted-mechanism": node["accounted_epsilon_audited_mechanism"],
        "audit-accounted": node["accounted_epsilon"],
        "audit-status": node["status"].split(":")[0],
    }


def write_audit(rows: list[dict], out: Path) -> None:
    """table_audit.md/.csv: per audited run, the accounted epsilon beside the audit's lower bound."""
    audited = [r for r in rows if "audit-epsilon-lower" in r]
    if not audited:
        return
    table = [["method", "target eps", "seed", "accounted eps (composed)", "accounted eps (audited mechanism)"]]
    table[0] += ["audited lower bound", "guesses", "correct", "status"]
    for r in audited:
        table.append(
            [
                r["variant"],
                r["epsilon"],
                str(r["seed"]),
                f"{r['audit-accounted']:.3f}" if r["audit-accounted"] is not None else "-",
                f"{r['audit-accounted-mechanism']:.3f}" if r["audit-accounted-mechanism"] is not None else "-",
                f"{r['audit-epsilon-lower']:.3f}",
                str(r["audit-guesses"]),
                str(r["audit-correct"]),
                r["audit-status"],
            ]
        )
    with open(out / "table_audit.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(table)
    md = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    md += ["| " + " | ".join(r) + " |" for r in table[1:]]
    head = "One-run privacy audit (privacy.audit-canaries): accounted epsilon vs the audit's 95% lower bound"
    (out / "table_audit.md").write_text(head + "\n\n" + "\n".join(md) + "\n")


def plot_audit(rows: list[dict], out: Path) -> None:
    """audit_vs_accounted.png: the audit's lower bound against the accounted epsilon of the
    mechanism it audits; a point above the diagonal is a broken mechanism or accounting."""
    audited = [r for r in rows if r.get("audit-accounted-mechanism") is not None]
    if not audited:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    for v in dict.fromkeys(r["variant"] for r in audited):
        pts = [(r["audit-accounted-mechanism"], r["audit-epsilon-lower"]) for r in audited if r["variant"] == v]
        ax.scatter(*zip(*pts, strict=True), label=v)
    top = max(max(r["audit-accounted-mechanism"], r["audit-epsilon-lower"]) for r in audited) * 1.1
    ax.plot([0, top], [0, top], color="gray", ls="--", lw=1, label="lower bound = accounted")
    ax.set_xlabel("accounted epsilon (audited mechanism)")
    ax.set_ylabel("audited lower bound (95%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "audit_vs_accounted.png", dpi=110)
    plt.close(fig)


def plot(rows: list[dict], out: Path, epsilons: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e for e in epsilons if e != "none"]
    panels = [("local-acc-last10", "local accuracy (%)"), ("neighbor-acc-last10", "neighbor accuracy (%)")]
    if not xs:  # no epsilon axis: one bar per variant
        _bars(plt, rows, out / "accuracy_by_variant.png")
        return
    figs = [("accuracy_vs_epsilon.png", panels)]
    if any(r.get("mia-shokri-acc") is not None for r in rows):
        figs.append(
            (
                "mia_vs_epsilon.png",
                [("mia-shokri-acc", "Shokri MIA accuracy (%)"), ("mia-loss-acc", "loss-threshold MIA accuracy (%)")],
            )
        )
    for fname, keys in figs:
        fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4))
        for ax, (key, label) in zip(np.atleast_1d(axes), keys, strict=True):
            for v in dict.fromkeys(r["variant"] for r in rows):
                pts = [
                    (float(e), 100 * np.mean([r[key] for r in rows if r["variant"] == v and r["epsilon"] == e]))
                    for e in xs
                    if any(r["variant"] == v and r["epsilon"] == e and r.get(key) is not None for r in rows)
                ]
                line = ax.plot(*zip(*pts, strict=True), marker="o", label=v)[0] if pts else None
                clean = [
                    r[key] for r in rows if r["variant"] == v and r["epsilon"] == "none" and r.get(key) is not None
                ]
                if clean and line is not None:
                    ax.axhline(100 * np.mean(clean), color=line.get_color(), ls=":", lw=1)
            if "mia" in key:
                ax.axhline(50, color="gray", ls="--", lw=1)
            ax.set_xscale("log")
            ax.set_xlabel("epsilon (dotted: no noise)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


# what defines a paper's setup: a --set of one of these (or of any key the preset sets) makes
# the comparison with the paper's numbers meaningless, so the paper column is left out
DEFAULT_CLIENTS = 10
SETUP_KEYS = ("dataset", "clip.model", "clip.pretrained", "partitioner", "dirichlet-alpha", "max-per-class")


def setup(preset: str | None, sets: list[str], clients: int | None) -> tuple[dict, int, dict | None]:
    """(base run config, clients per run, the paper's numbers or None) of a sweep: the preset,
    then every --set; the paper's numbers only while the setup is still the paper's."""
    base = dict(PRESETS.get(preset or "", {}))
    preset_clients = base.pop("_clients", DEFAULT_CLIENTS if preset else None)  # the papers' setups name it or use 10
    reference = base.pop("_reference", None)
    changed = []
    for item in sets:
        key, _, value = item.partition("=")
        value = parse_value(value)
        if (key in base and base[key] != value) or (key not in base and key in SETUP_KEYS):
            changed.append(f"{key}={value!r}")
        base[key] = value
    if clients is not None and preset_clients is not None and clients != preset_clients:
        changed.append(f"--clients {clients} (the preset: {preset_clients})")
    if reference and changed:
        log.warning("not the paper's setup (%s): its numbers are left out of the tables", ", ".join(changed))
        reference = None
    return base, int(clients or preset_clients or DEFAULT_CLIENTS), reference


def failed_row(variant: str, method: str, eps: str, seed: int, err: BaseException) -> dict:
    reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return {"variant": variant, "method": method, "epsilon": eps, "seed": seed, "status": "failed", "error": reason}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.experiments.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path.home() / "fedvlm-sweeps" / "sweep")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods (default: every DP-capable prompt method, unless --compare or --variant)",
    )
    p.add_argument("--compare", choices=sorted(COMPARISONS), help="a named comparison set of labelled variants")
    p.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar="LABEL METHOD [KEY=VALUE",
        help="a labelled variant: LABEL METHOD KEY=VALUE... (repeatable)",
    )
    p.add_argument("--epsilons", default=",".join(EPSILONS), help="'none' = no noise")
    p.add_argument("--seeds", default="0")
    p.add_argument("--ranks", default="8")
    p.add_argument("--residual", default="on", help="on, off or on,off (DP-FPL's ablation)")
    p.add_argument("--clients", type=int, default=None, help="clients per run (default: the preset's, else 10)")
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config overrides for every run")
    p.add_argument("--engine", choices=("inprocess", "flwr"), default="inprocess")
    p.add_argument("--mia", action="store_true", help="run the membership-inference attacks on every run")
    p.add_argument(
        "--audit",
        type=int,
        default=0,
        metavar="M",
        help="audit every private run with M canaries (privacy.audit-canaries): table_audit.md, audit_vs_accounted.png",
    )
    p.add_argument("--shadows", type=int, default=2)
    p.add_argument(
        "--online", type=int, default=0, help="with --mia: online-LiRA reference federations per run (even; 0 = none)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for name in ("strategies", "server_app", "fedvlm", "models", "data"):
        logging.getLogger(name).setLevel(logging.WARNING)

    base, clients, reference = setup(args.preset, args.set, args.clients)
    out = args.out.expanduser().resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    epsilons = [e.strip() for e in args.epsilons.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    residuals = [x.strip() == "on" for x in args.residual.split(",")]
    if any(len(v) < 2 for v in args.variant):
        p.error("--variant needs LABEL METHOD [KEY=VALUE ...]")
    variants = COMPARISONS.get(args.compare, []) + _labelled(args.variant)
    if args.methods is not None or not variants:
        methods = args.methods or ",".join(m.name for m in methods_of(PROMPT) if m.supports_dp)
        variants = list(_variants(methods.split(","), ranks, residuals)) + variants
    # A method without a DP mechanism runs at 'none' only (zero-shot, CoOp in a comparison set).
    plan = [
        (v, m, extra, e, s)
        for (v, m, extra) in variants
        for e in epsilons
        if e == "none" or get_method(m).supports_dp
        for s in seeds
    ]

    def raw_of(variant: str, method: str, extra: dict, eps: str, seed: int) -> dict:
        raw = {
            **base,
            **extra,
            "method": method,
            "seed": seed,
            "privacy.epsilon": 0.0 if eps == "none" else float(eps),
            "output-dir": str(out / "runs"),
            "run-name": f"{variant}-eps{eps}-seed{seed}",
        }
        if args.audit and (eps != "none" or get_method(method).family.noise_multiplier > 0):  # a private run
            raw["privacy.audit-canaries"] = args.audit
        return raw

    # every run's config is checked before the first starts: an impossible pair (FedOTP on a
    # ResNet CLIP) is a failed row at once, not a crash hours in
    refused: dict[str, ConfigError] = {}
    for entry in plan:
        raw = raw_of(*entry)
        try:
            validate(raw)
        except ConfigError as err:
            refused[raw["run-name"]] = err
            log.error("%s cannot run: %s", raw["run-name"], err)

    def report(rows: list[dict]) -> None:
        """summary.csv and every table, rewritten after each run (a failed one too)."""
        with open(out / "summary.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
        done = [r for r in rows if r["status"] != "failed"]
        write_tables(rows, out, epsilons, reference)
        write_failures(rows, out)
        write_audit(done, out)
        write_attack_table(
            done,
            out,
            "the published personalised prompts (server-*: every upload the server saw, attack.observe-uploads)",
        )

    rows: list[dict] = []
    t_all = time.time()
    for i, (variant, method, extra, eps, seed) in enumerate(plan, 1):
        raw = raw_of(variant, method, extra, eps, seed)
        name = raw["run-name"]
        if name in refused:
            rows.append(failed_row(variant, method, eps, seed, refused[name]))
            report(rows)
            continue
        results_path = out / "runs" / name / "results.json"
        t0 = time.time()
        data = json.loads(results_path.read_text()) if results_path.exists() else None
        try:
            if data is None or data["run"].get("status") not in ("finished", "stopped"):
                data = run_one(raw, clients, args.engine, out)
        except Exception as err:  # noqa: BLE001 - a failed variant is a row of the table, not the sweep's end
            rows.append(failed_row(variant, method, eps, seed, err))
            log.error("[%d/%d] %s failed: %s", i, len(plan), name, rows[-1]["error"])
            report(rows)
            continue
        row = {
            "variant": variant,
            "method": method,
            "epsilon": eps,
            "seed": seed,
            "local-acc-last10": data["final"].get("local-acc-last10-mean"),
            "neighbor-acc-last10": data["final"].get("neighbor-acc-last10-mean"),
            "local-acc": data["final"].get("local-acc"),
            "neighbor-acc": data["final"].get("neighbor-acc"),
            "status": data["run"]["status"],
        }
        if row["status"] == "failed":  # the ServerApp stopped with an error and said why
            row["error"] = str(data["run"].get("note") or "the run failed").splitlines()[0][:300]
        spent = (data.get("privacy", {}).get("rounds") or [{}])[-1]
        row["epsilon-spent"] = spent.get("epsilon")  # per record, every mechanism composed
        row.update(audit_row(data))
        if args.mia:
            mia_path = out / "runs" / name / "mia.json"
            if not mia_path.exists():
                from fedvlm.attacks.run import run_attacks

                run_attacks(out / "runs" / name, shadows=args.shadows, online=args.online)
            mia = json.loads(mia_path.read_text())["summary"]
            row.update(
                {
                    "mia-shokri-acc": mia["shokri"]["accuracy"],
                    "mia-shokri-auc": mia["shokri"]["auc"],
                    "mia-loss-acc": mia["loss-threshold"]["accuracy"],
                    "mia-loss-auc": mia["loss-threshold"]["auc"],
                }
            )
            row.update(attack_row({k: v["pooled"] for k, v in mia.items() if "pooled" in v}))
        rows.append(row)
        log.info(
            "[%d/%d] %s: local %.1f%% neighbor %s%s (%.0fs)",
            i,
            len(plan),
            name,
            100 * (row["local-acc-last10"] or 0),
            f"{100 * row['neighbor-acc-last10']:.1f}%" if row["neighbor-acc-last10"] is not None else "-",
            f" MIA {100 * row['mia-shokri-acc']:.1f}%" if args.mia else "",
            time.time() - t0,
        )
        report(rows)
    done = [r for r in rows if r["status"] != "failed"]
    plot(done, out, epsilons)
    plot_audit(done, out)
    plot_attacks(done, out)
    print((out / "table_final.md").read_text())
    print((out / "table_local.md").read_text())
    print((out / "table_neighbor.md").read_text())
    if args.mia:
        print((out / "table_mia.md").read_text())
    if (out / "table_attacks.md").exists():
        print((out / "table_attacks.md").read_text())
    if (out / "table_audit.md").exists():
        print((out / "table_audit.md").read_text())
    if (out / "table_failures.md").exists():
        print((out / "table_failures.md").read_text())
    log.info("sweep of %d runs done in %.0fs: %s", len(plan), time.time() - t_all, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
