"""Membership attacks in the sweep tools' tables and plots: each run's strongest attacks with their
bootstrap 95% intervals, and the attacks' true-positive rate at low false-positive rates against
the epsilon the run accounted (``experiments.sweep --mia``, ``experiments.lora_compare``).

An attack's pooled result (``mia.json`` or ``maxrenyi.json``) is ``{metric: {"value", "ci95"}}``
for metric in ``likelihood.roc_metrics``; a row keeps it flat as ``mia-<attack>-<metric>`` with
``-lo``/``-hi`` for the interval, so that summary.csv stays one value per cell.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

METRICS = ("auc", "tpr@1%fpr", "tpr@0.1%fpr")
CHANCE = {"auc": 0.5, "tpr@1%fpr": 0.01, "tpr@0.1%fpr": 0.001}


def attack_row(pooled_by_attack: dict[str, dict]) -> dict:
    """Flat row fields of every attack whose pooled metrics carry intervals."""
    row: dict = {}
    for name, pooled in pooled_by_attack.items():
        for metric in METRICS:
            if metric in pooled and isinstance(pooled[metric], dict):
                low, high = pooled[metric]["ci95"]
                row.update(
                    {
                        f"mia-{name}-{metric}": pooled[metric]["value"],
                        f"mia-{name}-{metric}-lo": low,
                        f"mia-{name}-{metric}-hi": high,
                    }
                )
    return row


def attacks_in(rows: list[dict]) -> list[str]:
    names = [k[len("mia-") : -len("-auc")] for r in rows for k in r if k.startswith("mia-") and k.endswith("-auc")]
    return [n for n in dict.fromkeys(names) if any(f"mia-{n}-auc-lo" in r for r in rows)]


def _cell(r: dict, name: str, metric: str) -> str:
    key = f"mia-{name}-{metric}"
    if r.get(key) is None:
        return "-"
    beyond = r[f"{key}-lo"] > CHANCE[metric]  # the whole interval above chance
    return f"{r[key]:.3f} [{r[f'{key}-lo']:.3f}, {r[f'{key}-hi']:.3f}]" + (" *" if beyond else "")


def write_attack_table(rows: list[dict], out: Path, label: str, keys: tuple[str, ...] = ("variant", "epsilon", "seed")):
    """``table_attacks.md/.csv``: per run, every interval attack's AUC and TPR at 1% and 0.1% FPR."""
    names = attacks_in(rows)
    if not names:
        return
    head = [*keys, "accounted eps"] + [f"{n} {m}" for n in names for m in METRICS]
    table = [head]
    for r in rows:
        spent = r.get("epsilon-spent")
        table.append(
            [str(r.get(k, "-")) for k in keys]
            + [f"{spent:.3f}" if spent is not None else "no DP"]
            + [_cell(r, n, m) for n in names for m in METRICS]
        )
    with open(out / "table_attacks.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(table)
    md = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    md += ["| " + " | ".join(row) + " |" for row in table[1:]]
    (out / "table_attacks.md").write_text(
        f"Membership attacks on {label}, pooled over clients: value [bootstrap 95% interval]; "
        "* = the whole interval above chance (AUC 0.5, TPR at x% FPR = x%)\n\n" + "\n".join(md) + "\n"
    )


STYLES = ("-", "--", ":", "-.")
MARKS = "o^sDv<>P"


def target_points(rows: list[dict], key: str, no_dp_x: float) -> list[tuple[float, float, float, float]]:
    """(accounted epsilon, value, interval low, interval high) of ``key`` per privacy target, each
    the mean over the target's seeds, by epsilon; a run without DP at ``no_dp_x``."""
    mine = [r for r in rows if r.get(key) is not None]
    pts = []
    for target in dict.fromkeys(r["epsilon"] for r in mine):
        runs = [r for r in mine if r["epsilon"] == target]
        x = float(np.mean([r.get("epsilon-spent") or no_dp_x for r in runs]))
        y, lo, hi = (float(np.mean([r[key + end] for r in runs])) for end in ("", "-lo", "-hi"))
        pts.append((x, y, lo, hi))
    return sorted(pts)


def plot_attacks(rows: list[dict], out: Path, series: str = "variant") -> None:
    """``attack_tpr_vs_epsilon.png``: TPR at 1% and at 0.1% FPR against the accounted epsilon, a
    colour per ``series`` (the method or variant) and a line style and marker per attack. A point
    is one privacy target: over several seeds, the mean of their accounted epsilons and TPRs, its
    bar the mean of their 95% bootstrap intervals. Runs without DP sit at the right edge, not
    joined to the line. The legends sit below the panels, off the data."""
    names = attacks_in(rows)
    if not names:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    spent = [r["epsilon-spent"] for r in rows if r.get("epsilon-spent")]
    no_dp_x = max(spent) * 4 if spent else 1.0  # where runs without noise are drawn
    attacked = [r for r in rows if any(r.get(f"mia-{n}-tpr@0.1%fpr") is not None for n in names)]
    groups = list(dict.fromkeys(r.get(series) for r in attacked))  # a method no attack applies to has no colour
    colours = {g: f"C{k % 10}" for k, g in enumerate(groups)}
    looks = {n: (STYLES[k % len(STYLES)], MARKS[k % len(MARKS)]) for k, n in enumerate(names)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, metric in zip(axes, ("tpr@1%fpr", "tpr@0.1%fpr"), strict=True):
        for group in groups:
            for name in names:
                pts = target_points([r for r in rows if r.get(series) == group], f"mia-{name}-{metric}", no_dp_x)
                if not pts:
                    continue
                x, y, lo, hi = (np.array(v) for v in zip(*pts, strict=True))
                bars = 100 * np.vstack([y - lo, hi - y])
                private = x != no_dp_x  # joined by a line; runs without noise: a marker on their own
                style, mark = looks[name]
                for keep, ls in ((private, style), (~private, "none")):
                    ax.errorbar(
                        x[keep],
                        100 * y[keep],
                        yerr=bars[:, keep],
                        marker=mark,
                        ls=ls,
                        capsize=3,
                        color=colours[group],
                        alpha=0.85,
                    )
        ax.axhline(100 * CHANCE[metric], color="gray", ls="--", lw=1)
        if spent:
            ax.axvline(no_dp_x / 2, color="gray", ls=":", lw=1)
            ax.text(no_dp_x, ax.get_ylim()[1], "no DP", ha="center", va="top", fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("accounted epsilon")
        ax.set_ylabel(f"TPR at {metric.split('@')[1].replace('fpr', '')} FPR (%)")
        ax.grid(alpha=0.3)
    several = any(len({r.get("seed") for r in rows if r.get(series) == g}) > 1 for g in groups)
    handles = [Line2D([], [], color=colours[g], lw=2, label=str(g)) for g in groups]
    handles += [Line2D([], [], color="dimgray", ls=looks[n][0], marker=looks[n][1], label=n) for n in names]
    handles.append(Line2D([], [], color="gray", ls="--", lw=1, label="chance (TPR = FPR)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=7, frameon=False)
    if several:
        fig.suptitle("each point: the mean over seeds (bar: the mean of their 95% bootstrap intervals)", fontsize=9)
    rows_of_legend = -(-len(handles) // min(len(handles), 5))
    fig.tight_layout(rect=(0, 0.05 * rows_of_legend + 0.02, 1, 1))
    fig.savefig(out / "attack_tpr_vs_epsilon.png", dpi=110)
    plt.close(fig)
