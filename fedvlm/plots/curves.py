"""A run's curves: every declared round figure that has a ``plot`` (``fedvlm.metrics``), one PNG
per plot, over rounds."""

from __future__ import annotations

import logging
from pathlib import Path

from fedvlm.metrics import METRICS, Metric

log = logging.getLogger(__name__)

STYLES = ("-", "--", ":", "-.")  # so that equal curves (a global model's local = neighbor) all show


def plot_groups(rounds: list[dict]) -> dict[str, list[Metric]]:
    """The plots a run's ``rounds`` fill: file name -> the declared metrics drawn in it that some
    round has, in catalogue order."""
    present = {k for r in rounds for k in r["metrics"]}
    groups: dict[str, list[Metric]] = {}
    for metric in METRICS.values():
        if metric.plot and metric.name in present:
            groups.setdefault(metric.plot, []).append(metric)
    return groups


def _points(metric: Metric, xs: list[int], rounds: list[dict]) -> list[tuple[int, float]]:
    """(round, value) of ``metric`` in every round that records it as a number; a value that is not
    one (a hand-edited or damaged results.json) is left out with a warning naming it."""
    pts, bad = [], []
    for x, r in zip(xs, rounds, strict=True):
        value = r["metrics"].get(metric.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            pts.append((x, value * metric.kind.scale))
        elif metric.name in r["metrics"]:
            bad.append(x)
    if bad:
        log.warning(
            "%s is not a number in round(s) %s of results.json: left out of its curve",
            metric.name,
            ", ".join(map(str, bad[:10])),
        )
    return pts


def title(data: dict) -> str:
    return f"{data['config']['method']} on {data['config']['dataset']}"


def draw_curves(data: dict, out_dir: Path) -> dict[str, list[str]]:
    """Draw the run's curves into ``out_dir``; what each file shows (file name -> metric names)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = data["rounds"]
    xs = [r["round"] for r in rounds]
    drawn = {}
    for fname, metrics in plot_groups(rounds).items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, metric in enumerate(metrics):
            pts = _points(metric, xs, rounds)
            if pts:
                ax.plot(*zip(*pts, strict=True), STYLES[i % len(STYLES)], marker="o", ms=3, label=metric.name)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(metrics[0].kind.axis)
        ax.set_title(title(data))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(out_dir) / fname
        fig.savefig(path, dpi=110)
        drawn[fname] = [m.name for m in metrics]
        plt.close(fig)
    return drawn
