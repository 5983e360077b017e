"""Write a federation's partitions as image folders, one per organisation.

    python -m fedvlm.deploy.export_folder --out ~/fedvlm-demo-data --num-partitions 2
    python -m fedvlm.deploy.export_folder --out /data/split --num-partitions 5 --set dataset=cifar10 data-root=/data

For a deployment demo without real organisations: each SuperNode then starts with
``--node-config "data-dir='<out>/client-<i>'"`` and trains on exactly that folder, the code path a
real organisation's own images take. The partition is the one a simulation with the same run
config computes (dataset, partitioner, seed, ...: ``--set`` takes run-config keys), and every
folder gets the federation's ``classes.txt`` so that labels mean the same class on every node.

Layout: ``<out>/client-<i>/{train,test}/<class>/<index>.png`` plus ``<out>/client-<i>/classes.txt``;
for a captioning run of the VLM methods (``--set method=fedrand``), the own-data VLM format
(``data.vlm_data.load_vlm_folder``): ``<out>/client-<i>/images/<index>.png``, ``data.jsonl`` (image,
captions, label, split) and ``labels.txt``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedvlm.client_app.node import node_data
from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
from fedvlm.client_app.vlm_node import vlm_node_data
from fedvlm.data.vlm_data import FOLDER_FILE, FOLDER_LABELS
from fedvlm.methods.validation import validate
from fedvlm.runconfig import ConfigError, RunConfig, parse_value
from fedvlm.spec import spec_of


def export_vlm_partitions(cfg: RunConfig, out: Path, num_partitions: int) -> list[Path]:
    """The run's captioning partitions as own-data VLM folders (the module docstring)."""
    written = []
    for pid in range(num_partitions):
        node = vlm_node_data(cfg, {PARTITION_ID: pid, NUM_PARTITIONS: num_partitions})
        if node.dataset.task != "caption":
            raise ConfigError(
                f"deploy.export_folder writes captioning folders; {cfg.dataset} is a {node.dataset.task} task: write "
                'its records as {"image", "question", "choices", "answer"} (data.vlm_data)'
            )
        folder = Path(out).expanduser() / f"client-{pid}"
        (folder / "images").mkdir(parents=True, exist_ok=True)
        lines = []
        for split_name, split in (("train", node.train), ("test", node.test)):
            for k in range(len(split)):
                rel = f"images/{split_name}-{k:06d}.png"
                split.images.image(k).convert("RGB").save(folder / rel)
                label = node.dataset.label_names[int(split.labels[k])]
                lines.append(
                    json.dumps({"image": rel, "captions": split.references[k], "label": label, "split": split_name})
                )
        (folder / FOLDER_FILE).write_text("\n".join(lines) + "\n")
        (folder / FOLDER_LABELS).write_text("\n".join(node.dataset.label_names) + "\n")
        written.append(folder)
    return written


def export_partitions(out: Path, num_partitions: int, overrides: dict | None = None) -> list[Path]:
    """One folder per partition, ``client-<i>`` under ``out``; refused where one holds anything
    already (two exports into one folder mixed two partitions' records, and a node trained on both)."""
    if num_partitions < 1:
        raise ConfigError(f"--num-partitions {num_partitions}: export at least one partition")
    used = [f for i in range(num_partitions) if (f := Path(out).expanduser() / f"client-{i}").exists()]
    used = [f for f in used if not f.is_dir() or any(f.iterdir())]
    if used:
        raise ConfigError(
            f"{used[0]} already holds files: export into an empty --out (or move the old export away); a folder "
            "of two exports would hold two partitions' records"
        )
    cfg = validate(dict(overrides or {}))
    if spec_of(cfg).family.image_text:
        return export_vlm_partitions(cfg, out, num_partitions)
    written = []
    for pid in range(num_partitions):
        node = node_data(cfg, {PARTITION_ID: pid, NUM_PARTITIONS: num_partitions})
        folder = Path(out).expanduser() / f"client-{pid}"
        names = node.splits.classnames
        for split_name, source, idx in (
            ("train", node.splits.train, node.part.train),
            ("test", node.splits.test, node.part.test),
        ):
            for k, i in enumerate(idx):
                label = int(source.labels[i])
                path = folder / split_name / names[label] / f"{k:06d}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                source.image(int(i)).convert("RGB").save(path)
        (folder / "classes.txt").write_text("\n".join(names) + "\n")
        written.append(folder)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.export_folder", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-partitions", type=int, required=True)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config keys (dataset, seed, ...)")
    args = p.parse_args(argv)
    try:
        overrides = {}
        for item in args.set:
            if "=" not in item:
                raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
            k, v = item.split("=", 1)
            overrides[k] = parse_value(v)
        # a node refuses a relative data-dir: the folders are named as it must be given them
        folders = export_partitions(args.out.expanduser().resolve(), args.num_partitions, overrides)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for f in folders:
        print(f"wrote {f}  (start its SuperNode with --node-config \"data-dir='{f}'\")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
