"""Image sources: a split of a dataset as labels plus a way to load any image by index.

Labels are available without decoding an image (partitioning needs only them); images load
lazily as RGB PIL images, the input every CLIP preprocess accepts. ``identity`` names the
source for people (dataset and split); ``content_key`` names what it serves, and keys every
cache of what is computed from its images (image features): the pixels of in-memory images,
each file's resolved path with its size and modification time, the labels and the order. A
photo moved between class folders, a file replaced under the same name, or another data-root
holding the same dataset each give another key, so a cache never serves what is no longer there.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from fedvlm.errors import PublicError


class DatasetError(ValueError):
    """A dataset that cannot be loaded; the message says what is missing and how to fix it. Its
    text may name a record (a file that cannot be read, a class folder), so it stays on the node
    (``fedvlm.errors``); ``DataSetupError`` is the setup-level kind, whose text may leave."""


class DataSetupError(PublicError, DatasetError):
    """A dataset that cannot be found or set up: its text names only the node's configured
    folders, the federation's shared class list and the dataset's name, never a record."""


class ImageSource:
    labels: np.ndarray
    identity: str

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, i: int) -> Image.Image:
        raise NotImplementedError

    def _hash_content(self, h) -> None:
        """Feed ``h`` what identifies every image this source serves, in order."""
        raise NotImplementedError

    @functools.cached_property
    def content_key(self) -> str:
        h = hashlib.sha256(type(self).__name__.encode())
        self._hash_content(h)
        h.update(np.ascontiguousarray(self.labels, dtype=np.int64).tobytes())
        return h.hexdigest()[:24]


def hash_files(h, paths: Iterable[Path]) -> None:
    """Each file's resolved path, size and modification time (its folder resolved once)."""
    folders: dict[str, str] = {}
    for path in paths:
        folder, name = os.path.split(os.fspath(path))
        if folder not in folders:
            folders[folder] = os.path.realpath(folder)
        try:
            st = os.stat(path)
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            stamp = "missing"  # loading it fails later, naming the file
        h.update(f"{folders[folder]}/{name}\0{stamp}\n".encode())


class ArraySource(ImageSource):
    """Images held in memory as uint8 arrays [N, H, W, 3] or [N, H, W]."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, identity: str):
        if len(images) != len(labels):
            raise ValueError("images and labels differ in length")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.identity = identity

    def image(self, i: int) -> Image.Image:
        return Image.fromarray(self.images[i]).convert("RGB")

    def _hash_content(self, h) -> None:
        h.update(str(self.images.shape).encode())
        h.update(np.ascontiguousarray(self.images).tobytes())


class FileSource(ImageSource):
    """Images on disk, one path per sample."""

    def __init__(self, paths: Sequence[Path], labels: np.ndarray, identity: str):
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.identity = identity

    def image(self, i: int) -> Image.Image:
        try:
            with Image.open(self.paths[i]) as img:
                return img.convert("RGB")
        # PIL: truncated, unknown format, bad header; a decompression bomb (more pixels than PIL's
        # limit allows) is its own exception class, which escaped without the file's name
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
            raise DatasetError(
                f"image {self.paths[i]} of {self.identity} cannot be read ({type(err).__name__}: {err}): replace or "
                "remove it"
            ) from err

    def _hash_content(self, h) -> None:
        hash_files(h, self.paths)


class SubsetSource(ImageSource):
    """A subset of another source, relabelled (e.g. a class dropped, a split carved out)."""

    def __init__(self, base: ImageSource, indices: np.ndarray, labels: np.ndarray, identity: str):
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.identity = identity

    def image(self, i: int) -> Image.Image:
        return self.base.image(int(self.indices[i]))

    def _hash_content(self, h) -> None:
        h.update(self.base.content_key.encode())
        h.update(self.indices.tobytes())


class ConcatSource(ImageSource):
    """Two sources one after the other (a reference node's training pool: train, then test)."""

    def __init__(self, first: ImageSource, second: ImageSource):
        self.first, self.second = first, second
        self.labels = np.r_[first.labels, second.labels]
        self.identity = f"{first.identity}+{second.identity}"

    def image(self, i: int) -> Image.Image:
        return self.first.image(i) if i < len(self.first) else self.second.image(i - len(self.first))

    def _hash_content(self, h) -> None:
        h.update(f"{self.first.content_key}+{self.second.content_key}".encode())


class DatasetSource(ImageSource):
    """A torchvision dataset: ``dataset[i][0]`` is a PIL image. Its content: the pixel array of
    a dataset held in memory (CIFAR), else every file under its root (images, label and split
    files), with the root resolved."""

    def __init__(self, dataset, labels: np.ndarray, identity: str):
        self.dataset = dataset
        self.labels = np.asarray(labels, dtype=np.int64)
        self.identity = identity

    def image(self, i: int) -> Image.Image:
        return self.dataset[i][0].convert("RGB")

    def _hash_content(self, h) -> None:
        data = getattr(self.dataset, "data", None)
        if isinstance(data, np.ndarray):
            h.update(str(data.shape).encode())
            h.update(np.ascontiguousarray(data).tobytes())
            return
        root = Path(self.dataset.root)
        hash_files(h, sorted(p for p in root.rglob("*") if p.is_file()))


@dataclass
class DatasetSplits:
    """A dataset ready to partition: class names (they feed the prompts) and two splits."""

    name: str
    classnames: list[str]
    train: ImageSource
    test: ImageSource

    @property
    def n_classes(self) -> int:
        return len(self.classnames)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-class split: ``test_fraction`` of every class (at least one image) goes to test."""
    rng = np.random.default_rng(seed)
    train: list[int] = []
    test: list[int] = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = max(1, int(round(len(idx) * test_fraction))) if len(idx) > 1 else 0
        test.extend(idx[:n_test])
        train.extend(idx[n_test:])
    return np.sort(np.array(train, dtype=np.int64)), np.sort(np.array(test, dtype=np.int64))


def limit_per_class(
    source: ImageSource, max_per_class: int, seed: int, make_identity: Callable[[str], str]
) -> ImageSource:
    """Keep at most ``max_per_class`` images of each class (few-shot training sets)."""
    if max_per_class <= 0:
        return source
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    for c in np.unique(source.labels):
        idx = np.flatnonzero(source.labels == c)
        chosen.extend(rng.choice(idx, size=min(max_per_class, len(idx)), replace=False))
    keep = np.sort(np.array(chosen, dtype=np.int64))
    return SubsetSource(source, keep, source.labels[keep], make_identity(source.identity))


@dataclass(frozen=True)
class LabelCounts:
    """How many of a node's training and test records carry each label (a class, or a VLM
    dataset's split label): what the partition plot draws (``fedvlm.plots.partition``)."""

    names: list[str]
    train: np.ndarray  # records per label, in ``names``' order
    test: np.ndarray

    @classmethod
    def of(cls, names: list[str], train_labels: np.ndarray, test_labels: np.ndarray) -> LabelCounts:
        n = len(names)
        return cls(
            list(names),
            np.bincount(np.asarray(train_labels, dtype=np.int64), minlength=n),
            np.bincount(np.asarray(test_labels, dtype=np.int64), minlength=n),
        )
