"""Deterministic splits of a labelled dataset over federated clients.

Every process (the server, each simulated or deployed client) computes the same split from
the labels and the seed alone, so no index lists travel over the network.

- ``pathological``: the classes, shuffled with the seed, are cut into one disjoint block
  per client; a client holds every training and test image of its block's classes, and its
  "neighbor" test set is every other client's test classes (DP-FPL's evaluation).
- ``dirichlet``: per-class client proportions ~ Dirichlet(alpha) (flwr-datasets'
  ``DirichletPartitioner``); a client's test set follows its own training label mix.
- ``iid``: a seeded shuffle cut into equal shards (flwr-datasets' ``IidPartitioner``).
- ``quantity-skew``: a seeded shuffle cut by size ratios such as 45:9:1 (flwr-datasets'
  ``SizePartitioner``); test sets are equal IID shards.

``class-split = base-to-novel`` (``base_to_novel``) runs any of them on the base classes alone
and gives each client a share of the novel classes' test records besides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PARTITIONERS = ("pathological", "dirichlet", "iid", "quantity-skew")
CLASS_SPLITS = ("none", "base-to-novel")


class PartitionError(ValueError):
    pass


@dataclass(frozen=True)
class Partition:
    """What one client holds: indices into the train and test splits."""

    train: np.ndarray
    test: np.ndarray
    neighbor: np.ndarray | None  # other clients' test classes (pathological only)
    classes: tuple[int, ...]  # classes present in this client's training data
    novel: np.ndarray | None = None  # test records of classes no client trains on (base-to-novel)
    base: int | None = None  # base-to-novel: classes 0..base-1 are base, the rest novel; None: no split

    def label_space(self, which: str) -> slice:
        """The labels an evaluation of ``which`` ('test', 'neighbor', 'novel') chooses among."""
        if self.base is None:
            return slice(None)
        return slice(self.base, None) if which == "novel" else slice(0, self.base)


def parse_ratios(text: str) -> list[float]:
    return [float(p) for p in text.split(":")]


def _as_dataset(labels: np.ndarray, order: np.ndarray):
    from datasets import Dataset  # flwr-datasets partitions a Hugging Face Dataset

    return Dataset.from_dict({"idx": order.astype(np.int64), "label": labels[order].astype(np.int64)})


def _indices(partitioner, pid: int) -> np.ndarray:
    return np.sort(np.asarray(partitioner.load_partition(pid)["idx"], dtype=np.int64))


def _equal_shards(n: int, num_partitions: int, rng: np.random.Generator) -> list[np.ndarray]:
    from flwr_datasets.partitioner import IidPartitioner

    part = IidPartitioner(num_partitions)
    part.dataset = _as_dataset(np.zeros(n, dtype=np.int64), rng.permutation(n))
    return [_indices(part, i) for i in range(num_partitions)]


def pathological(train_labels, test_labels, n_classes, num_partitions, seed) -> list[Partition]:
    if num_partitions > n_classes:
        raise PartitionError(
            f"the pathological split needs at least one class per client: {n_classes} classes "
            f"cannot be split over {num_partitions} clients; use fewer clients or another partitioner"
        )
    order = np.random.default_rng(seed).permutation(n_classes)
    blocks = np.array_split(order, num_partitions)
    parts = []
    for block in blocks:
        mine_train = np.isin(train_labels, block)
        mine_test = np.isin(test_labels, block)
        parts.append(
            Partition(
                train=np.flatnonzero(mine_train),
                test=np.flatnonzero(mine_test),
                neighbor=np.flatnonzero(~mine_test),
                classes=tuple(sorted(int(c) for c in block)),
            )
        )
    return parts


def dirichlet(train_labels, test_labels, n_classes, num_partitions, seed, alpha) -> list[Partition]:
    from flwr_datasets.partitioner import DirichletPartitioner

    min_size = max(1, min(10, len(train_labels) // (4 * num_partitions)))
    part = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=alpha,
        min_partition_size=min_size,
        self_balancing=False,
        shuffle=True,
        seed=seed,
    )
    part.dataset = _as_dataset(train_labels, np.arange(len(train_labels)))
    try:
        train_parts = [_indices(part, i) for i in range(num_partitions)]
    except ValueError as err:
        raise PartitionError(
            f"the Dirichlet split (alpha={alpha}) could not give every one of {num_partitions} "
            f"clients at least {min_size} training images: {err}. Use fewer clients, a larger alpha, or more data "
            "(the embedded dataset: raise embedded-per-class)"
        ) from err
    # Test images of each class go to clients in proportion to their share of that class.
    counts = np.stack([np.bincount(train_labels[p], minlength=n_classes) for p in train_parts]).astype(float)
    rng = np.random.default_rng([seed, 1])
    test_parts: list[list[int]] = [[] for _ in range(num_partitions)]
    for c in range(n_classes):
        idx = rng.permutation(np.flatnonzero(test_labels == c))
        share = (
            counts[:, c] / counts[:, c].sum() if counts[:, c].sum() > 0 else np.full(num_partitions, 1 / num_partitions)
        )
        cuts = np.round(np.cumsum(share) * len(idx)).astype(int)[:-1]
        for pid, chunk in enumerate(np.split(idx, cuts)):
            test_parts[pid].extend(chunk.tolist())
    return [
        Partition(
            train=tp,
            test=np.sort(np.array(te, dtype=np.int64)),
            neighbor=None,
            classes=tuple(int(c) for c in np.unique(train_labels[tp])),
        )
        for tp, te in zip(train_parts, test_parts, strict=True)
    ]


def iid(train_labels, test_labels, num_partitions, seed) -> list[Partition]:
    short = min(len(train_labels), len(test_labels))
    if short < num_partitions:
        raise PartitionError(
            f"the iid split cannot give each of {num_partitions} clients a training and a test image: the dataset "
            f"has {len(train_labels)} training and {len(test_labels)} test images. Use fewer clients, or more data "
            "(the embedded dataset: raise embedded-per-class)"
        )
    rng = np.random.default_rng(seed)
    train = _equal_shards(len(train_labels), num_partitions, rng)
    test = _equal_shards(len(test_labels), num_partitions, rng)
    return [
        Partition(tr, te, None, tuple(int(c) for c in np.unique(train_labels[tr])))
        for tr, te in zip(train, test, strict=True)
    ]


def quantity_skew(train_labels, test_labels, num_partitions, seed, ratios) -> list[Partition]:
    from flwr_datasets.partitioner import SizePartitioner

    if len(ratios) != num_partitions:
        raise PartitionError(
            f"run config 'quantity-ratios' gives {len(ratios)} ratios but there are "
            f"{num_partitions} clients; give one ratio per client, e.g. "
            f"'{':'.join(['1'] * num_partitions)}'"
        )
    n = len(train_labels)
    weights = np.asarray(ratios) / np.sum(ratios)
    sizes = np.floor(weights * n).astype(int)
    sizes[np.argmax(sizes)] += n - sizes.sum()  # hand the rounding remainder to the largest
    if (sizes < 1).any():
        raise PartitionError(f"quantity-ratios {ratios} leave a client with no training data on {n} images")
    rng = np.random.default_rng(seed)
    part = SizePartitioner(sizes.tolist())
    part.dataset = _as_dataset(train_labels, rng.permutation(n))
    train = [_indices(part, i) for i in range(num_partitions)]
    test = _equal_shards(len(test_labels), num_partitions, rng)
    return [
        Partition(tr, te, None, tuple(int(c) for c in np.unique(train_labels[tr])))
        for tr, te in zip(train, test, strict=True)
    ]


def make_partitions(
    name: str,
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    n_classes: int,
    num_partitions: int,
    seed: int,
    alpha: float = 0.3,
    ratios: str = "45:9:1",
    class_split: str = "none",
) -> list[Partition]:
    """All clients' partitions; every process computes the same result."""
    if class_split == "base-to-novel":
        return base_to_novel(name, train_labels, test_labels, n_classes, num_partitions, seed, alpha, ratios)
    if class_split != "none":
        raise PartitionError(f"unknown class split {class_split!r}; accepted: {', '.join(CLASS_SPLITS)}")
    if num_partitions < 1:
        raise PartitionError(f"need at least one client, got {num_partitions}")
    train_labels = np.asarray(train_labels)
    test_labels = np.asarray(test_labels)
    if name == "pathological":
        return pathological(train_labels, test_labels, n_classes, num_partitions, seed)
    if name == "dirichlet":
        return dirichlet(train_labels, test_labels, n_classes, num_partitions, seed, alpha)
    if name == "iid":
        return iid(train_labels, test_labels, num_partitions, seed)
    if name == "quantity-skew":
        return quantity_skew(train_labels, test_labels, num_partitions, seed, parse_ratios(ratios))
    raise PartitionError(f"unknown partitioner {name!r}; accepted: {', '.join(PARTITIONERS)}")


def base_to_novel(name, train_labels, test_labels, n_classes, num_partitions, seed, alpha, ratios) -> list[Partition]:
    """CoCoOp's base-to-novel protocol (Zhou et al., CVPR 2022), as FedOTP, FedPGP and pFedMoAP
    report it: the first half of the classes (rounded up) are base, the rest novel. The clients'
    training data and their local (and neighbour) test sets are split from base-class records
    alone, by the run's partitioner; each client also gets an equal seeded share of the novel
    classes' test records, which no client trains on. Each set is scored among its own classes
    (``Partition.label_space``), as CoCoOp scores base and novel apart."""
    if n_classes < 2:
        raise PartitionError(f"base-to-novel needs at least 2 classes, the dataset has {n_classes}")
    base = (n_classes + 1) // 2
    train_labels, test_labels = np.asarray(train_labels), np.asarray(test_labels)
    train, test = np.flatnonzero(train_labels < base), np.flatnonzero(test_labels < base)
    inner = make_partitions(name, train_labels[train], test_labels[test], base, num_partitions, seed, alpha, ratios)
    novel = np.flatnonzero(test_labels >= base)
    shares = _equal_shards(len(novel), num_partitions, np.random.default_rng([seed, 2])) if len(novel) else []
    return [
        Partition(
            train=train[p.train],
            test=test[p.test],
            neighbor=None if p.neighbor is None else test[p.neighbor],
            classes=p.classes,
            novel=np.sort(novel[shares[i]]) if len(novel) else np.zeros(0, dtype=np.int64),
            base=base,
        )
        for i, p in enumerate(inner)
    ]
