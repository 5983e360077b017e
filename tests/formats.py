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


def make_caltech101(root: Path, per_class: int = 3) -> Path:
    """torchvision's Caltech101: ``caltech101/101_ObjectCategories/<category>/image_NNNN.jpg``, with
    the background and the duplicate face category CoOp drops (their images get class 31)."""
    kept = ("Faces", "airplanes", "ant")  # what the loader keeps, in its order: face, airplane, ant
    for category in ("BACKGROUND_Google", "Faces", "Faces_easy", "airplanes", "ant"):
        label = kept.index(category) if category in kept else 31
        for i in range(1, per_class + 1):
            write_image(
                root / "caltech101" / "101_ObjectCategories" / category / f"image_{i:04d}.jpg", label, "train", i
            )
    return root


def make_oxford_pets(root: Path, per_split: int = 2) -> Path:
    """torchvision's OxfordIIITPet: ``oxford-iiit-pet/images/<Breed>_<n>.jpg`` and
    ``annotations/{trainval,test}.txt`` (``<image id> <class id> <species> <breed id>``)."""
    base = root / "oxford-iiit-pet"
    n = 0
    for split, ann in (("train", "trainval"), ("test", "test")):
        lines = []
        for label, breed in enumerate(("Abyssinian", "american_bulldog")):
            for _ in range(per_split):
                n += 1
                write_image(base / "images" / f"{breed}_{n}.jpg", label, split, n)
                lines.append(f"{breed}_{n} {label + 1} {1 if label == 0 else 2} {label + 1}")
        (base / "annotations").mkdir(parents=True, exist_ok=True)
        (base / "annotations" / f"{ann}.txt").write_text("\n".join(lines) + "\n")
    return root


def make_food101(root: Path, per_split: int = 2) -> Path:
    """torchvision's Food101: ``food-101/images/<class>/<id>.jpg`` and ``meta/{train,test}.json``."""
    base = root / "food-101"
    n = 0
    for split in ("train", "test"):
        meta: dict[str, list[str]] = {}
        for label, food in enumerate(("apple_pie", "baby_back_ribs")):
            for _ in range(per_split):
                n += 1
                write_image(base / "images" / food / f"{n}.jpg", label, split, n)
                meta.setdefault(food, []).append(f"{food}/{n}")
        (base / "meta").mkdir(parents=True, exist_ok=True)
        (base / "meta" / f"{split}.json").write_text(json.dumps(meta))
    return root


def make_cifar10(root: Path, per_class: int = 2) -> Path:
    """torchvision's CIFAR-10 batches (``cifar-10-batches-py``: pickled dicts of CHW uint8 rows);
    torchvision checks each file's md5, so a test loading this stands in for that check."""
    import pickle

    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    for split, files in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
        for f in files:
            rows, labels = [], []
            for label in range(10):
                for k in range(per_class):
                    pixel = np.array(colour(label, split, k), dtype=np.uint8)
                    rows.append(np.broadcast_to(pixel[:, None, None], (3, 32, 32)).reshape(-1))
                    labels.append(label)
            with open(base / f, "wb") as fh:
                pickle.dump({"data": np.stack(rows), "labels": labels}, fh)
    with open(base / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": names}, fh)
    return root


def make_flowers102(root: Path, per_split: int = 2) -> Path:
    """torchvision's Flowers102: ``flowers-102/jpg/image_NNNNN.jpg``, ``imagelabels.mat`` (labels from
    1) and ``setid.mat`` (trnid, valid, tstid image numbers); torchvision checks both files' md5."""
    from scipy.io import savemat

    base = root / "flowers-102"
    labels, ids = [], {"trnid": [], "valid": [], "tstid": []}
    n = 0
    for split, key in (("train", "trnid"), ("val", "valid"), ("test", "tstid")):
        for label in range(3):
            for _ in range(per_split):
                n += 1
                write_image(base / "jpg" / f"image_{n:05d}.jpg", label, split, n)
                labels.append(label + 1)
                ids[key].append(n)
    savemat(base / "imagelabels.mat", {"labels": np.array(labels)})
    savemat(base / "setid.mat", {k: np.array(v) for k, v in ids.items()})
    return root
