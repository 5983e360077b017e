"""A VLM client node: its name and its share of a captioning or VQA dataset.

Same rules as ``client_app.node`` (one code path for simulation and deployment): node config
``partition-id``/``num-partitions`` takes a seeded Dirichlet (or other) split of the run's
dataset by its split label (object class, topic). Cached per process.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedvlm.client_app.node import noise_source
from fedvlm.data.partitioners import make_partitions
from fedvlm.data.vlm_data import VLMDataset, VLMSplit, load_vlm_dataset
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


_DATASETS: dict[tuple, VLMDataset] = {}
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
        raise ConfigError(
            "node config 'data-dir' (an organisation's own image folder) is supported by the prompt-learning "
            "methods; a VLM node takes a partition of the run's dataset: start it with "
            '--node-config "partition-id=0 num-partitions=N" and point data-root at its copy of the data'
        )
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise ConfigError(
            "this SuperNode's node config lacks 'partition-id'/'num-partitions': start it with "
            '--node-config "partition-id=0 num-partitions=N"'
        )
    pid, n = int(node_config["partition-id"]), int(node_config["num-partitions"])
    if not 0 <= pid < n:
        raise ConfigError(f"node config partition-id={pid} is outside 0..num-partitions-1 ({n})")
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
