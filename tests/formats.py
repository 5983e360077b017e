"""Small copies of real dataset layouts, made by the tests themselves: every image is a solid
colour that encodes its class and its split, so a test can check every label a loader gives
(``decode``) without any download.

The layouts are the ones torchvision's loaders and CoOp's split files expect on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

SPLITS = ("train", "val", "test")
SIDE = 24


def colour(label: int, split: str, variant: int = 0) -> tuple[int, int, int]:
    """The colour of an image of class ``label`` in ``split``: red encodes the class, green the split,
    blue tells images of one class and split apart."""
    return (8 * label + 4, 60 * SPLITS.index(split) + 30, (16 * variant + 8) % 256)


def decode(img: Image.Image) -> tuple[int, str]:
    """(class, split) of an image ``colour`` made (JPEG moves a solid colour by a few levels)."""
    r, g, _ = np.asarray(img.convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(0)
    return int(round((r - 4) / 8)), SPLITS[int(round((g - 30) / 60))]


def write_image(path: Path, label: int, split: str, variant: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (SIDE, SIDE), colour(label, split, variant)).save(path, quality=95)
    return path


def make_dtd(root: Path, classes: tuple[str, ...] = ("banded", "blotchy", "braided"), per_split: int = 2) -> Path:
    """torchvision's DTD: ``dtd/dtd/images/<class>/<class>_NNNN.jpg`` and
    ``dtd/dtd/labels/{train,val,test}1.txt`` listing ``<class>/<file>``."""
    base = root / "dtd" / "dtd"
    lines: dict[str, list[str]] = {s: [] for s in SPLITS}
    n = 0
    for label, name in enumerate(classes):
        for split in SPLITS:
            for _ in range(per_split):
                rel = f"{name}/{name}_{n:04d}.jpg"
                write_image(base / "images" / rel, label, split, n)
                lines[split].append(rel)
                n += 1
    for split, rows in lines.items():
        (base / "labels").mkdir(parents=True, exist_ok=True)
        (base / "labels" / f"{split}1.txt").write_text("\n".join(rows) + "\n")
    return root


def make_image_folder(root: Path, classes: tuple[str, ...] = ("cat", "dog", "fox"), per_class: int = 4) -> Path:
    """An organisation's own folder: ``<root>/<class>/*.png``, every image of the 'train' colour."""
    for label, name in enumerate(classes):
        for i in range(per_class):
            write_image(root / name / f"{name}_{i}.png", label, "train", i)
    return root


def make_coop_split(root: Path, name: str = "dtd") -> Path:
    """CoOp's split file beside a DTD tree (``split_zhou_DescribableTextures.json``): [path, label, class]."""
    make_dtd(root)
    images = root / "dtd" / "dtd" / "images"
    spec = {}
    for split in ("train", "val", "test"):
        rows = []
        for line in (root / "dtd" / "dtd" / "labels" / f"{split}1.txt").read_text().split():
            cls = line.split("/")[0]
            label = decode(Image.open(images / line))[0]
            rows.append([line, label, cls])
        spec[split] = rows
    (root / "split_zhou_DescribableTextures.json").write_text(json.dumps(spec))
    return root
