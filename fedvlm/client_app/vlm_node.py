"""A VLM client node: its name and its share of a captioning or VQA dataset.

Same rules as ``client_app.node`` (one code path for simulation and deployment): node config
``partition-id``/``num-partitions`` takes a seeded Dirichlet (or other) split of the run's
dataset by its split label (object class, topic); ``data-dir`` is an organisation's own folder of
images and ``data.jsonl`` records for the run's task (``data.vlm_data.load_vlm_folder``), which
it trains and evaluates on exactly, drawing its DP noise from the OS. Cached per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedvlm.client_app.node import noise_source, partition_of
from fedvlm.data.partitioners import make_partitions
from fedvlm.data.sources import LabelCounts
from fedvlm.data.vlm_data import VLMDataError, VLMDataset, VLMSplit, load_vlm_dataset, load_vlm_folder
from fedvlm.runconfig import ConfigError, RunConfig
from fedvlm.utils.rng import node_seed


@dataclass
class VLMNodeData:
    name: str
    partition_id: int
    dataset: VLMDataset
    train: VLMSplit
    test: VLMSplit
    config: dict
    noise_source: str  # where its DP randomness comes from (privacy.mechanisms)

    @property
    def seed(self) -> int:
        """The integer that stands for this node in its random draws' keys (``utils.rng``)."""
        return node_seed(self.partition_id, self.name)

    def label_counts(self) -> LabelCounts:
        """Its records per split label (object class, topic): the partition plot's."""
        return LabelCounts.of(self.dataset.label_names, self.train.labels, self.test.labels)


_DATASETS: dict[tuple, VLMDataset] = {}  # by what loaded it: the run's dataset, or a node's own folder
_NODES: dict[tuple, tuple[VLMSplit, VLMSplit]] = {}


def vlm_dataset(cfg: RunConfig, shadow: bool = False) -> VLMDataset:
    name = cfg.dataset + ("-shadow" if shadow else "")
    key = (name, cfg.data_root, cfg.vlm.ood_captions, cfg.vlm.max_train, cfg.vlm.max_test, cfg.vlm.hf_dataset)
    if key not in _DATASETS:
        _DATASETS[key] = load_vlm_dataset(
            name, cfg.data_root, cfg.vlm.ood_captions, cfg.vlm.max_train, cfg.vlm.max_test, cfg.vlm.hf_dataset
        )
    return _DATASETS[key]


def vlm_node_data(cfg: RunConfig, node_config: dict, shadow: bool = False) -> VLMNodeData:
    if node_config.get("data-dir"):
        if shadow:
            raise ConfigError("membership-attack shadow federations train on simulated partitions, not on a data-dir")
        root = Path(str(node_config["data-dir"])).expanduser()
        own = ("own", str(root), cfg.dataset, cfg.test_fraction, cfg.seed)
        if own not in _DATASETS:
            try:
                _DATASETS[own] = load_vlm_folder(root, cfg.dataset, cfg.test_fraction, cfg.seed)
            except VLMDataError as err:
                raise ConfigError(str(err)) from err
        ds = _DATASETS[own]
        name = str(node_config.get("name") or root.name)
        return VLMNodeData(name, -1, ds, ds.train, ds.test, dict(node_config), noise_source(cfg, node_config, True))
    pid, n = partition_of(node_config, "its own images and data.jsonl")
    ds = vlm_dataset(cfg, shadow)
    key = (id(ds), cfg.partitioner, n, pid, cfg.seed, cfg.dirichlet_alpha, cfg.quantity_ratios)
    if key not in _NODES:
        parts = make_partitions(
            cfg.partitioner,
            ds.train.labels,
            ds.test.labels,
            ds.n_labels,
            n,
            cfg.seed,
            alpha=cfg.dirichlet_alpha,
            ratios=cfg.quantity_ratios,
        )
        part = parts[pid]
        _NODES[key] = (ds.train.subset(part.train, f"p{pid}of{n}"), ds.test.subset(part.test, f"p{pid}of{n}"))
    train, test = _NODES[key]
    name = str(node_config.get("name") or f"client-{pid}")
    return VLMNodeData(name, pid, ds, train, test, dict(node_config), noise_source(cfg, node_config, own_data=False))
