"""``partition.png`` and ``partition.json``: how a simulation's records are split over its nodes.

Counted by the family's own node loader (``Family.node_data``, the function every simulated node
runs on its partition id), so the picture is the split the nodes trained on, not a second
computation of it; drawn by ``python -m fedvlm.plots RUN_DIR`` in the researcher's process,
never by a ServerApp (which would load every node's data). Only a simulation has a split to
draw: a deployed node with its own ``data-dir`` reports no label counts (they would tell the
server its label mix), and the run draws no partition plot. ``partition.json`` keeps the
counts, so the plot is redrawn from the run folder alone; the bars are drawn by flwr-datasets'
own ``plot_label_distributions``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedvlm.plots.curves import title
from fedvlm.spec import spec_of

FILE, COUNTS = "partition.png", "partition.json"
LEGEND_UP_TO = 20  # labels: stacked bars with a legend up to this many, beyond it the matrix (rows named)
BARS_UP_TO = 60  # nodes: a stacked bar each up to this many, beyond it a node-by-label matrix


def simulated_partitions(data: dict) -> tuple[int, list[tuple[str, int]]] | None:
    """(num-partitions, [(node name, partition id)]) of a run whose nodes all took a simulated
    partition (None: some node trained on its own data, or none joined)."""
    nodes = (data.get("run") or {}).get("nodes") or []
    if not nodes or any(n.get("partition_id", -1) < 0 or not n.get("num_partitions") for n in nodes):
        return None
    counts = {int(n["num_partitions"]) for n in nodes}
    if len(counts) != 1:
        return None
    return counts.pop(), sorted(((n["name"], int(n["partition_id"])) for n in nodes), key=lambda x: x[1])


def count_labels(data: dict) -> dict | None:
    """The run's label counts per node, from its config (None: not a simulated split)."""
    found = simulated_partitions(data)
    if found is None:
        return None
    from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
    from fedvlm.methods.validation import validate

    cfg = validate(data["config"])
    n, nodes = found
    out: dict = {"names": [], "nodes": {}}
    for name, pid in nodes:
        counts = spec_of(cfg).family.node_data(cfg, {PARTITION_ID: pid, NUM_PARTITIONS: n}).label_counts()
        out["names"] = counts.names
        out["nodes"][name] = {"partition_id": pid, "train": counts.train.tolist(), "test": counts.test.tolist()}
    return out


def _partitioner(names: list[str], train: dict[str, list[int]]):
    """A flwr-datasets partitioner holding exactly these counts (node i's records are a block of
    labels), for its label-distribution plot."""
    from datasets import ClassLabel, Dataset, Features
    from flwr_datasets.partitioner import Partitioner

    labels = np.concatenate([np.repeat(np.arange(len(names)), counts) for counts in train.values()])
    bounds = np.cumsum([0, *(sum(c) for c in train.values())])

    class Counted(Partitioner):
        def load_partition(self, partition_id: int) -> Dataset:
            return self.dataset.select(range(bounds[partition_id], bounds[partition_id + 1]))

        @property
        def num_partitions(self) -> int:
            return len(train)

    part = Counted()
    part.dataset = Dataset.from_dict(
        {"label": labels.astype(np.int64)}, features=Features({"label": ClassLabel(names=names)})
    )
    return part


def _draw_matrix(data: dict, names: list[str], train: dict[str, list[int]], path: Path) -> None:
    """Many nodes or many labels: one column per node, one row per label, the colour its records,
    at a size that does not grow with the nodes (a bar per node would need 0.35 inch each)."""
    import matplotlib.pyplot as plt

    matrix = np.array(list(train.values()), dtype=float).T
    fig, ax = plt.subplots(figsize=(11, 4.8))
    image = ax.imshow(np.ma.masked_equal(matrix, 0), aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="training records (blank: none)")
    ax.set_title(f"{title(data)}: training records per label ({data['config'].get('partitioner')} split)")
    ax.set_xlabel(f"node (partition id, {len(train)} nodes)")
    ax.set_ylabel(f"label ({len(names)})")
    if len(names) <= 2 * LEGEND_UP_TO:
        ax.set_yticks(range(len(names)), names, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_partition(data: dict, out_dir: Path) -> dict[str, list[str]]:
    """Count (once: ``partition.json``) and draw a simulated run's split; what it shows."""
    path = Path(out_dir) / COUNTS
    if path.exists():
        counts = json.loads(path.read_text())
    else:
        counts = count_labels(data)
        if counts is None:
            return {}
        path.write_text(json.dumps(counts))
    import matplotlib.pyplot as plt
    from flwr_datasets.visualization import plot_label_distributions

    names, nodes = counts["names"], counts["nodes"]
    train = {name: node["train"] for name, node in nodes.items()}
    # many nodes, or more labels than a legend can name (stacked bars would be colours no reader
    # can tell apart): the matrix, whose rows are named up to 40 labels
    if len(nodes) > BARS_UP_TO or len(names) > LEGEND_UP_TO:
        _draw_matrix(data, names, train, Path(out_dir) / FILE)
        return {FILE: ["training records per label and node (a cell per node and label)"]}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(nodes) + 3), 4.2))
    plot_label_distributions(
        _partitioner(names, train),
        "label",
        plot_type="bar",
        size_unit="absolute",
        axis=ax,
        title=f"{title(data)}: training records per label ({data['config'].get('partitioner')} split)",
        legend=len(names) <= LEGEND_UP_TO,
        legend_title="label",
        verbose_labels=True,
    )
    ax.set_xticks(range(len(nodes)), list(nodes), rotation=90, fontsize=7)
    ax.set_xlabel("node")
    ax.set_ylabel("training records")
    fig.tight_layout()
    fig.savefig(Path(out_dir) / FILE, dpi=110)
    plt.close(fig)
    return {FILE: ["training records per label and node"]}
