"""PNG plots of a run: accuracy and loss over rounds."""

from __future__ import annotations

from pathlib import Path


def plot_run(data: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = data["rounds"]
    if not rounds:
        return []
    title = f"{data['config']['method']} on {data['config']['dataset']}"
    xs = [r["round"] for r in rounds]
    paths = []
    for fname, keys, ylabel, scale in (
        ("accuracy.png", ("local-acc", "neighbor-acc", "train-acc"), "accuracy (%)", 100.0),
        ("loss.png", ("train-loss", "local-loss", "neighbor-loss"), "cross-entropy", 1.0),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = False
        for key, style in zip(keys, ("-", "--", ":"), strict=False):
            pts = [(x, r["metrics"][key] * scale) for x, r in zip(xs, rounds, strict=True) if key in r["metrics"]]
            if pts:  # dashed/dotted so that equal curves (a global model's local = neighbor) both show
                ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=key)
                drawn = True
        if drawn:
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = Path(out_dir) / fname
            fig.savefig(path, dpi=110)
            paths.append(path)
        plt.close(fig)
    return paths
