"""Membership attacks in the sweep tools' tables and plots: each run's strongest attacks with their
bootstrap 95% intervals, and the attacks' true-positive rate at low false-positive rates against
the epsilon the run accounted (``experiments.sweep --mia``, ``experiments.lora_compare``).

An attack's pooled result (``mia.json`` or ``maxrenyi.json``) is ``{metric: {"value", "ci95",
"chance", "non-members"}}`` for metric in ``likelihood.roc_metrics``; a row keeps it flat as
``mia-<attack>-<metric>`` with ``-lo``/``-hi`` for the interval and ``-chance`` for its chance
level, so that summary.csv stays one value per cell. A figure is compared with its own chance
level, never a nominal one: with fewer than 1000 non-members "TPR at 0.1% FPR" is the TPR at zero
false positives, whose chance is 1 / (non-members + 1) (``likelihood.chance``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedvlm.experiments.sweep_report import SPENT, write_table
from fedvlm.utils.files import atomic_savefig

METRICS = ("auc", "tpr@1%fpr", "tpr@0.1%fpr")
ENDS = {"value": "", "low": "-lo", "high": "-hi", "chance": "-chance"}  # a flat row's keys of one figure


def predates_chance(pooled_by_attack: dict[str, dict] | None) -> bool:
    """Whether a run's attack report (pooled metrics by attack) was written before each interval
    figure carried its chance level: its attacks must run again, and the run with them (the
    published runs keep no prompts to attack afresh)."""
    figures = (f for pooled in (pooled_by_attack or {}).values() for f in pooled.values() if isinstance(f, dict))
    return any("ci95" in f and "chance" not in f for f in figures)


def attack_row(pooled_by_attack: dict[str, dict]) -> dict:
    """Flat row fields of every attack whose pooled metrics carry intervals."""
    row: dict = {}
    for name, pooled in pooled_by_attack.items():
        if predates_chance({name: pooled}):
            raise ValueError(
                f"its {name} report was written before each attack figure carried its chance level: run it "
                "again to attack it under this code (move its folder away; a finished run is reused)"
            )
        for metric in METRICS:
            if metric in pooled and isinstance(pooled[metric], dict):
                figure = pooled[metric]
                low, high = figure["ci95"]
                found = {"value": figure["value"], "low": low, "high": high, "chance": figure["chance"]}
                row.update({f"mia-{name}-{metric}{ENDS[k]}": v for k, v in found.items()})
    return row


def attacks_in(rows: list[dict]) -> list[str]:
    names = [k[len("mia-") : -len("-auc")] for r in rows for k in r if k.startswith("mia-") and k.endswith("-auc")]
    return [n for n in dict.fromkeys(names) if any(f"mia-{n}-auc-lo" in r for r in rows)]


def _cell(r: dict, name: str, metric: str) -> str:
    key = f"mia-{name}-{metric}"
    if r.get(key) is None:
        return "-"
    beyond = r[f"{key}-lo"] > r[f"{key}-chance"]  # the whole interval above this figure's chance
    return f"{r[key]:.3f} [{r[f'{key}-lo']:.3f}, {r[f'{key}-hi']:.3f}] (chance {r[f'{key}-chance']:.4f})" + (
        " *" if beyond else ""
    )


def write_attack_table(rows: list[dict], out: Path, label: str, keys: tuple[str, ...] = ("variant", "epsilon", "seed")):
    """``table_attacks.md/.csv``: per run, every interval attack's AUC and TPR at 1% and 0.1% FPR."""
    names = attacks_in(rows)
    if not names:
        return
    table = [[*keys, "eps spent"] + [f"{n} {m}" for n in names for m in METRICS]]
    for r in rows:
        spent = r.get(SPENT)
        table.append(
            [str(r.get(k, "-")) for k in keys]
            + [f"{spent:.3f}" if spent is not None else "no DP"]
            + [_cell(r, n, m) for n in names for m in METRICS]
        )
    title = (
        f"Membership attacks on {label}, pooled over clients: value [bootstrap 95% interval]; "
        "chance = what a score ignoring the model expects from the same counts (AUC 0.5; TPR at FPR <= x: "
        "(floor(x n) + 1) / (n + 1) with n non-members); * = the whole interval above it"
    )
    write_table(out, "attacks", title, table)


STYLES = ("-", "--", ":", "-.")
MARKS = "o^sDv<>P"


def target_points(rows: list[dict], key: str, no_dp_x: float) -> list[tuple[float, float, float, float, float]]:
    """(accounted epsilon, value, interval low, interval high, chance) of ``key`` per privacy
    target, each the mean over the target's seeds, by epsilon; a run without DP at ``no_dp_x``."""
    mine = [r for r in rows if r.get(key) is not None]
    pts = []
    for target in dict.fromkeys(r["epsilon"] for r in mine):
        runs = [r for r in mine if r["epsilon"] == target]
        x = float(np.mean([r.get(SPENT) or no_dp_x for r in runs]))
        value, low, high, luck = (float(np.mean([r[key + ENDS[end]] for r in runs])) for end in ENDS)
        pts.append((x, value, low, high, luck))
    return sorted(pts)


def _draw_points(ax, pts: list, no_dp_x: float, look: tuple[str, str], colour: str) -> None:
    """One attack's points of one series (``target_points``) with their bars and chance ticks."""
    if not pts:
        return
    x, y, lo, hi, luck = (np.array(v) for v in zip(*pts, strict=True))
    ax.plot(x, 100 * luck, ls="none", marker="_", ms=14, mew=2, color="gray")
    bars = 100 * np.vstack([y - lo, hi - y])
    private = x != no_dp_x  # joined by a line; runs without noise: a marker on their own
    style, mark = look
    for keep, ls in ((private, style), (~private, "none")):
        ax.errorbar(x[keep], 100 * y[keep], yerr=bars[:, keep], marker=mark, ls=ls, capsize=3, color=colour, alpha=0.85)


def plot_attacks(rows: list[dict], out: Path, series: str = "variant") -> None:
    """``attack_tpr_vs_epsilon.png``: TPR at 1% and at 0.1% FPR against the accounted epsilon, a
    colour per ``series`` (the method or variant) and a line style and marker per attack. A point
    is one privacy target: over several seeds, the mean of their accounted epsilons and TPRs, its
    bar the mean of their 95% bootstrap intervals, and a gray tick at the same epsilon its own
    chance level (which depends on the non-members the attack had). Runs without DP sit at the
    right edge, not joined to the line. The legends sit below the panels, off the data."""
    names = attacks_in(rows)
    if not names:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    spent = [r[SPENT] for r in rows if r.get(SPENT)]
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
                _draw_points(ax, pts, no_dp_x, looks[name], colours[group])
        if spent:
            ax.axvline(no_dp_x / 2, color="gray", ls=":", lw=1)
            ax.text(no_dp_x, ax.get_ylim()[1], "no DP", ha="center", va="top", fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("epsilon spent (per record)")
        ax.set_ylabel(f"TPR at {metric.split('@')[1].replace('fpr', '')} FPR (%)")
        ax.grid(alpha=0.3)
    several = any(len({r.get("seed") for r in rows if r.get(series) == g}) > 1 for g in groups)
    handles = [Line2D([], [], color=colours[g], lw=2, label=str(g)) for g in groups]
    handles += [Line2D([], [], color="dimgray", ls=looks[n][0], marker=looks[n][1], label=n) for n in names]
    chance = "its chance (from its non-member count)"
    handles.append(Line2D([], [], color="gray", ls="none", marker="_", ms=14, mew=2, label=chance))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=7, frameon=False)
    if several:
        fig.suptitle("each point: the mean over seeds (bar: the mean of their 95% bootstrap intervals)", fontsize=9)
    rows_of_legend = -(-len(handles) // min(len(handles), 5))
    fig.tight_layout(rect=(0, 0.05 * rows_of_legend + 0.02, 1, 1))
    atomic_savefig(fig, out / "attack_tpr_vs_epsilon.png", 110)
    plt.close(fig)
