"""What a client node is: its name, its data and its backbone, built from the Flower context.

Two ways a node gets data, one code path:
- simulation (or a deployment that shares a known dataset): node config holds
  ``partition-id`` and ``num-partitions``; the node loads the run's dataset and takes its
  partition (every process computes the same split from the seed);
- an organisation's own data: node config holds ``data-dir`` (an image folder); the node
  trains and tests on exactly that folder, no partition involved.

Everything here is cached per process: a Ray worker serves many simulated nodes and rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
from fedvlm.client_app.privacy_floor import MAX_EPSILON
from fedvlm.data.membership import reference_node_data
from fedvlm.data.partitioners import Partition, make_partitions
from fedvlm.data.registry import DatasetSplits, load_dataset, load_image_folder
from fedvlm.data.sources import LabelCounts, limit_per_class
from fedvlm.privacy.mechanisms import node_noise_source
from fedvlm.runconfig import ConfigError, RunConfig
from fedvlm.utils.rng import node_seed
from fedvlm.utils.runtime import simulated


@dataclass
class NodeData:
    name: str
    partition_id: int  # -1 for a node with its own data directory
    splits: DatasetSplits
    part: Partition
    config: dict  # the node config it was built from
    noise_source: str  # where its DP randomness comes from (privacy.mechanisms)

    @property
    def seed(self) -> int:
        """The integer that stands for this node in its random draws' keys (``utils.rng``)."""
        return node_seed(self.partition_id, self.name)

    def label_counts(self) -> LabelCounts:
        """Its records per class (the partition plot's; own test records only)."""
        labels = self.splits.train.labels
        return LabelCounts.of(self.splits.classnames, labels[self.part.train], self.splits.test.labels[self.part.test])


_SPLITS: dict[tuple, DatasetSplits] = {}
_PARTS: dict[tuple, list[Partition]] = {}


def _dataset(cfg: RunConfig) -> DatasetSplits:
    how: dict[str, Any] = dict(
        data_root=cfg.data_root,
        download=cfg.download,
        test_fraction=cfg.test_fraction,
        max_per_class=cfg.max_per_class,
        seed=cfg.seed,
        embedded_per_class=cfg.embedded_per_class,
    )
    key = (cfg.dataset, *how.values())
    if key not in _SPLITS:
        _SPLITS[key] = load_dataset(cfg.dataset, **how)
    return _SPLITS[key]


def node_data(cfg: RunConfig, node_config: dict) -> NodeData:
    """This node's data, from its node config (see the module docstring)."""
    if node_config.get("data-dir"):
        return _own_data(cfg, node_config)
    pid, n = partition_of(node_config, "its own image folder")
    splits = _dataset(cfg)
    part = _partitions(cfg, splits, n)[pid]
    if cfg.attack.reference >= 0:  # an online-LiRA reference federation (python -m fedvlm.attacks --online)
        splits, part = reference_node_data(splits, part, cfg.attack.candidate_seed, pid, cfg.attack.reference)
    name = str(node_config.get("name") or f"client-{pid}")
    return NodeData(name, pid, splits, part, dict(node_config), noise_source(cfg, node_config, own_data=False))


def partition_of(node_config: dict, own_data: str) -> tuple[int, int]:
    """(partition id, number of partitions) of a node simulated on a partition of the run's
    dataset, refused with the fix where its node config names none (``own_data``: what its
    ``data-dir`` would hold instead)."""
    if PARTITION_ID not in node_config or NUM_PARTITIONS not in node_config:
        raise ConfigError(
            "this SuperNode has neither 'data-dir' nor 'partition-id'/'num-partitions' in its node config: start it "
            f"with --node-config \"data-dir='/path/to/folder'\" ({own_data}) or "
            '"partition-id=0 num-partitions=N" (a partition of the run\'s dataset)'
        )
    pid, n = int(node_config[PARTITION_ID]), int(node_config[NUM_PARTITIONS])
    if not 0 <= pid < n:
        raise ConfigError(f"node config partition-id={pid} is outside 0..num-partitions-1 ({n})")
    return pid, n


def _own_data(cfg: RunConfig, node_config: dict) -> NodeData:
    """A deployed node's own image folder (``data-dir``), all of it its own partition."""
    if cfg.attack.reference >= 0:
        raise ConfigError(
            "attack.reference (an online-LiRA reference federation) needs simulated partitions: this node "
            "trains on its own data-dir; run reference federations with python -m fedvlm.attacks --online"
        )
    data_dir = Path(str(node_config["data-dir"])).expanduser()
    key = ("own", str(data_dir), cfg.test_fraction, cfg.max_per_class, cfg.seed)
    if key not in _SPLITS:
        splits = load_image_folder(data_dir, cfg.test_fraction)
        splits.train = limit_per_class(
            splits.train, cfg.max_per_class, cfg.seed, lambda i: f"{i}/max{cfg.max_per_class}"
        )
        _SPLITS[key] = splits
    splits = _SPLITS[key]
    part = Partition(
        train=np.arange(len(splits.train)),
        test=np.arange(len(splits.test)),
        neighbor=None,
        classes=tuple(int(c) for c in np.unique(splits.train.labels)),
    )
    name = str(node_config.get("name") or data_dir.name)
    return NodeData(name, -1, splits, part, dict(node_config), noise_source(cfg, node_config, own_data=True))


def _partitions(cfg: RunConfig, splits: DatasetSplits, n: int) -> list[Partition]:
    """The run's dataset split into ``n`` partitions (made once per process, dataset and split;
    ``splits`` is one of ``_SPLITS``, kept for the process, so its id names it)."""
    how: dict[str, Any] = dict(alpha=cfg.dirichlet_alpha, ratios=cfg.quantity_ratios, class_split=cfg.class_split)
    key = (id(splits), cfg.partitioner, n, cfg.seed, *how.values())
    if key not in _PARTS:
        labels = (splits.train.labels, splits.test.labels, splits.n_classes)
        _PARTS[key] = make_partitions(cfg.partitioner, *labels, n, cfg.seed, **how)
    return _PARTS[key]


def noise_source(cfg: RunConfig, node_config: dict, own_data: bool) -> str:
    """Where this node's DP randomness comes from (``privacy.mechanisms.node_noise_source``)."""
    try:
        return node_noise_source(
            node_config,
            own_data=own_data,
            simulated=simulated(),
            states_limit=MAX_EPSILON in node_config,
            run_choice=cfg.privacy.noise_source,
            private=cfg.privacy.enabled,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
