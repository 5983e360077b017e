"""``privacy.png``: what the run's privacy ledger says each round, and what was measured against it.

Left: the epsilon a record has spent after each round (results.json ``privacy.rounds``): the
largest over the nodes (what ``privacy.max-epsilon`` stops on), their mean, and the band from the
least to the most spent node; the target ``privacy.epsilon`` and the budget ``privacy.max-epsilon``
as lines; the one-run audit's lower bound (``audit``) at the round it was computed, beside the
accounted epsilon of the mechanism it audits. Right: each node's epsilon after the last round (a
histogram past ``BARS`` nodes), with the best membership attack's TPR at 0.1% FPR and AUC in the
corner when the folder holds its family's attack report (``Family.attack_report``: mia.json,
maxrenyi.json or global_attack.json; read by ``attacks.reports``, nothing attacked; redraw with
``python -m fedvlm.plots RUN_DIR`` after attacking, as a sweep's ``--mia`` does).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fedvlm.methods.registry import FAMILIES, METHODS
from fedvlm.metrics import EPSILON_MEAN, EPSILON_SPENT
from fedvlm.plots.curves import title
from fedvlm.privacy.ledger import final_spent, round_spread

log = logging.getLogger(__name__)

FILE = "privacy.png"
BARS = 40  # above this many nodes, the right panel is a histogram


def best_attack(attacks: dict[str, dict]) -> tuple[str, float, float, float] | None:
    """The pooled attack with the highest TPR at 0.1% FPR of a run's attack report (``Family.
    reported_attacks``): (name, TPR, its chance level, AUC)."""
    best = None
    for name, pooled in attacks.items():
        if not isinstance(pooled.get("tpr@0.1%fpr"), dict):
            continue
        tpr, auc = pooled["tpr@0.1%fpr"], pooled["auc"]["value"]
        if best is None or tpr["value"] > best[1]:
            best = (name, float(tpr["value"]), float(tpr["chance"]), float(auc))
    return best


def _reported_attacks(data: dict, run_dir: Path) -> dict[str, dict] | None:
    """The pooled attacks of the run's family's report in ``run_dir``, or None (a run folder of
    an older fedvlm names its method, not its family)."""
    run, method = data.get("run") or {}, (data.get("config") or {}).get("method")
    family = FAMILIES.get(str(run.get("family"))) or (METHODS[method].family if method in METHODS else None)
    read = family.reported_attacks if family is not None else None
    return read(run_dir) if read is not None else None


def draw_privacy(data: dict, out_dir: Path) -> dict[str, list[str]]:
    """Draw ``privacy.png`` when the run kept a ledger with at least one round; what it shows."""
    ledger = data.get("privacy") or {}
    rounds = ledger.get("rounds") or []
    if not rounds:
        return {}
    import matplotlib.pyplot as plt

    fig, (ax, right) = plt.subplots(1, 2, figsize=(11, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    shown = _spent_over_rounds(ax, data, ledger, rounds)
    _per_node(right, ledger, rounds[-1]["round"])
    shown += _attack_corner(right, data, Path(out_dir))
    fig.tight_layout()
    fig.savefig(Path(out_dir) / FILE, dpi=110)
    plt.close(fig)
    return {FILE: shown}


def _spent_over_rounds(ax, data: dict, ledger: dict, rounds: list[dict]) -> list[str]:
    """The epsilon spent round by round (band over nodes, max, mean), the target, the budget and
    the one-run audit's bound; the figures drawn, as the round records name them."""
    from matplotlib.ticker import MaxNLocator

    settings = ledger.get("settings") or {}
    xs = [r["round"] for r in rounds]
    low, mean, high = zip(*(round_spread(r) for r in rounds), strict=True)
    shown = [EPSILON_SPENT, EPSILON_MEAN, "per-node band"]
    ax.fill_between(xs, low, high, alpha=0.2, label="band: least to most spent node")
    ax.plot(xs, high, "-", marker="o", ms=3, label="max over nodes")
    ax.plot(xs, mean, "--", label="mean over nodes")
    if settings.get("epsilon"):
        ax.axhline(settings["epsilon"], color="gray", ls=":", label=f"target privacy.epsilon = {settings['epsilon']:g}")
        shown.append("target")
    if settings.get("max_epsilon"):
        budget = f"budget privacy.max-epsilon = {settings['max_epsilon']:g}"
        ax.axhline(settings["max_epsilon"], color="red", ls="-.", label=budget)
        shown.append("budget")
    for name, node in sorted(((data.get("audit") or {}).get("nodes") or {}).items()):
        bound = f"audit lower bound, {name} ({node['canaries']} canaries)"
        ax.plot([node["round"]], [node["epsilon_lower"]], "v", color="black", ms=8, label=bound)
        accounted = "accounted epsilon of the audited mechanism"
        ax.plot(
            [node["round"]],
            [node["accounted_epsilon_audited_mechanism"]],
            "^",
            color="black",
            mfc="none",
            ms=8,
            label=accounted,
        )
        shown.append("audit")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"epsilon spent per record (delta {settings.get('delta', 0):g})")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title(data)}: accountant {settings.get('accountant', '?')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: never over a curve
    return shown


def _per_node(right, ledger: dict, last_round: int) -> None:
    """Each node's epsilon after the last round: bars, or a histogram past ``BARS`` nodes."""
    last = final_spent(ledger)
    names, values = list(last), list(last.values())
    if len(values) <= BARS:
        right.bar(range(len(values)), values, color="tab:blue")
        right.set_xticks(range(len(values)), names, rotation=90, fontsize=7)
        right.set_ylabel("epsilon after the last round")
    else:
        right.hist(values, bins=30, color="tab:blue")
        right.set_xlabel("epsilon after the last round")
        right.set_ylabel("nodes")
    right.set_title(f"per node, after round {last_round}")
    right.grid(alpha=0.3, axis="y")


def _attack_corner(right, data: dict, out_dir: Path) -> list[str]:
    """The best membership attack's figures in a corner, where the run has a report."""
    try:  # a report that cannot be read costs the picture its corner, not the picture
        reported = _reported_attacks(data, out_dir)
        attack = best_attack(reported) if reported else None
    except Exception as err:  # noqa: BLE001
        log.warning("privacy.png drawn without the membership attack: its report could not be read: %s", err)
        return []
    if attack is None:
        return []
    name, tpr, luck, auc = attack
    right.text(
        0.98,
        0.97,
        f"best membership attack: {name}\nTPR at FPR <= 0.1% {tpr:.3f} (chance {luck:.4f}), AUC {auc:.3f}",
        transform=right.transAxes,
        ha="right",
        va="top",
        fontsize=8,
        bbox={"facecolor": "white", "alpha": 0.8},
    )
    return ["membership attack"]
