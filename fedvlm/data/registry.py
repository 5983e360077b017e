"""The dataset registry: every dataset name the run config accepts, and how to load it.

- ``embedded``: the generated shapes domain (``data.embedded``), offline and deterministic;
  ``embedded-shadow`` is an independent draw of it (shadow data for membership attacks).
- ``digits``: scikit-learn's bundled 8x8 handwritten digits (real data, ships with sklearn).
- ``motifs``: the 10 shapes of the generated motifs domain at 16 px under a cool illuminant
  (``data.motifs``), Reprogrammable-FL's offline target task.
- torchvision sets from ``data-root`` (downloaded there when ``download=true`` and the
  network allows): caltech101, oxford-pets, flowers102, food101, dtd, cifar10, cifar100. If
  CoOp's split file (``split_zhou_<Name>.json``, used by CoOp, PromptFL, FedOTP and DP-FPL)
  sits in data-root, its train/test split and class names are used, as in those papers.
- ``image-folder``: an organisation's own ``<root>/<class>/*.jpg`` (or ``<root>/train/<class>``
  and ``<root>/test/<class>``).

Class names always come with the data: they are what the prompts say.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedvlm.data import embedded, motifs
from fedvlm.data.sources import (
    ArraySource,
    DatasetError,
    DatasetSource,
    DatasetSplits,
    DataSetupError,
    FileSource,
    SubsetSource,
    limit_per_class,
    stratified_split,
)
from fedvlm.runconfig import datasets as catalogue
from fedvlm.utils.files import load_json, read_utf8
from fedvlm.utils.imports import load

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
EMBEDDED_TRAIN_PER_CLASS = 64
EMBEDDED_TEST_PER_CLASS = 24
MOTIFS_TRAIN_PER_CLASS = 200  # 2,000 images: about 670 per client of the paper's 3
MOTIFS_TEST_PER_CLASS = 60


def _clean(name: str) -> str:
    return name.replace("_", " ").strip()


def load_embedded(request: catalogue.Request) -> DatasetSplits:
    """The embedded task; ``embedded-shadow``: an independent draw of the same task (other seeds),
    the disjoint data a membership-inference attacker trains shadow models on."""
    shadow = request.name == "embedded-shadow"
    seeds = (3, 4) if shadow else (1, 2)
    per_class = request.embedded_per_class or EMBEDDED_TRAIN_PER_CLASS
    tr_x, tr_y = embedded.generate(per_class, seed=seeds[0], style="task")[:2]
    te_x, te_y = embedded.generate(per_class * EMBEDDED_TEST_PER_CLASS // EMBEDDED_TRAIN_PER_CLASS, seeds[1], "task")[
        :2
    ]
    size = "" if per_class == EMBEDDED_TRAIN_PER_CLASS else f"-{per_class}"  # the default keeps its cached features
    tag = f"embedded{'-shadow' if shadow else ''}{size}-{embedded.domain_version()}"
    return DatasetSplits(
        "embedded-shadow" if shadow else "embedded",
        list(embedded.CLASSNAMES),
        ArraySource(tr_x, tr_y, f"{tag}/train"),
        ArraySource(te_x, te_y, f"{tag}/test"),
    )


def load_motifs(request: catalogue.Request) -> DatasetSplits:
    tr_x, tr_y = motifs.generate(MOTIFS_TRAIN_PER_CLASS, seed=11, split="target")
    te_x, te_y = motifs.generate(MOTIFS_TEST_PER_CLASS, seed=12, split="target")
    tag = f"motifs-{motifs.domain_version()}"
    return DatasetSplits(
        "motifs",
        list(motifs.TARGET_CLASSES),
        ArraySource(tr_x, tr_y, f"{tag}/train"),
        ArraySource(te_x, te_y, f"{tag}/test"),
    )


DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def load_digits(request: catalogue.Request) -> DatasetSplits:
    from sklearn.datasets import load_digits as sk_digits

    test_fraction = request.test_fraction
    d = sk_digits()
    images = np.clip(d.images * 16, 0, 255).astype(np.uint8)  # values 0..16 -> 0..255
    labels = d.target.astype(np.int64)
    tr, te = stratified_split(labels, test_fraction, seed=0)
    tag = f"sklearn-digits/tf{test_fraction}"
    return DatasetSplits(
        "digits",
        [f"digit {n}" for n in DIGIT_NAMES],
        ArraySource(images[tr], labels[tr], f"{tag}/train"),
        ArraySource(images[te], labels[te], f"{tag}/test"),
    )


# --- CoOp split files -----------------------------------------------------------------------

# dataset -> (split file name, image directories relative to data-root to try)
COOP_SPLITS = {
    "caltech101": (
        "split_zhou_Caltech101.json",
        ["caltech101/101_ObjectCategories", "caltech-101/101_ObjectCategories", "101_ObjectCategories"],
    ),
    "oxford-pets": ("split_zhou_OxfordPets.json", ["oxford-iiit-pet/images", "oxford_pets/images", "images"]),
    "flowers102": ("split_zhou_OxfordFlowers.json", ["flowers-102/jpg", "oxford_flowers/jpg", "jpg"]),
    "food101": ("split_zhou_Food101.json", ["food-101/images", "images"]),
    "dtd": ("split_zhou_DescribableTextures.json", ["dtd/dtd/images", "dtd/images", "images"]),
}


def _find_coop_split(name: str, root: Path) -> tuple[Path, Path] | None:
    if name not in COOP_SPLITS:
        return None
    fname, image_dirs = COOP_SPLITS[name]
    for split_path in (root / fname, *[root / d.split("/")[0] / fname for d in image_dirs]):
        if split_path.is_file():
            for d in image_dirs:
                if (root / d).is_dir():
                    return split_path, root / d
            raise DataSetupError(
                f"found CoOp split file {split_path} but no image directory under {root} "
                f"(looked for {', '.join(image_dirs)})"
            )
    return None


def _load_coop_split(name: str, split_path: Path, image_dir: Path) -> DatasetSplits:
    spec = load_json(split_path, "download the split file again (CoOp's split_zhou_*.json)")
    names: dict[int, str] = {}
    out = {}
    for split in ("train", "test"):
        rows = spec[split]
        for _, label, cname in rows:
            names[int(label)] = cname
        out[split] = FileSource(
            [image_dir / p for p, _, _ in rows], np.array([int(r[1]) for r in rows]), f"{name}/coop-{split}"
        )
    classnames = [_clean(names[i]) for i in range(len(names))]
    return DatasetSplits(name, classnames, out["train"], out["test"])


# --- torchvision ----------------------------------------------------------------------------


def _labels_of(ds) -> np.ndarray:
    for attr in ("targets", "_labels", "y"):
        if hasattr(ds, attr):
            return np.asarray(getattr(ds, attr), dtype=np.int64)
    return np.array([ds[i][1] for i in range(len(ds))], dtype=np.int64)


def _open(name: str, factory: Callable, root: Path, download: bool, expected: str):
    try:
        return factory(download=download)
    except Exception as err:  # torchvision raises RuntimeError, URLError, OSError...
        how = (
            "the download failed (no network here?); download it on a connected machine and copy it"
            if download
            else "set download=true where the network allows, or place the files"
        )
        raise DatasetError(
            f"dataset {name!r} could not be opened under data-root {str(root)!r}: {err}. "
            f"Expected layout: {expected}; {how} there."
        ) from err


# Caltech101 as CoOp uses it: no background class, no duplicate "Faces_easy", readable names.
CALTECH_IGNORED = {"BACKGROUND_Google", "Faces_easy"}
CALTECH_RENAMED = {"airplanes": "airplane", "Faces": "face", "Leopards": "leopard", "Motorbikes": "motorbike"}


def load_torchvision(request: catalogue.Request) -> DatasetSplits:
    name, root, download = request.name, Path(request.data_root), request.download
    if not download and not root.is_dir():
        raise DataSetupError(
            f"data-root {str(root)!r} does not exist; create it with the {name} files or set download=true"
        )
    coop = _find_coop_split(name, root)
    if coop:
        return _load_coop_split(name, *coop)
    loader = {"cifar10": _cifar, "cifar100": _cifar, "caltech101": _caltech}.get(name, _official)
    return loader(name, root, download, request.test_fraction)


def _cifar(name: str, root: Path, download: bool, test_fraction: float) -> DatasetSplits:
    import torchvision.datasets as tvd

    r = str(root)
    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    folder = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
    train = _open(name, lambda download: cls(r, train=True, download=download), root, download, f"{r}/{folder}/")
    test = _open(name, lambda download: cls(r, train=False, download=download), root, download, f"{r}/{folder}/")
    return DatasetSplits(
        name,
        [_clean(c) for c in train.classes],
        DatasetSource(train, _labels_of(train), f"{name}/train"),
        DatasetSource(test, _labels_of(test), f"{name}/test"),
    )


def _caltech(name: str, root: Path, download: bool, test_fraction: float) -> DatasetSplits:
    """Caltech-101 without its background classes, split per class (it has no official split)."""
    import torchvision.datasets as tvd

    r = str(root)
    ds = _open(
        name,
        lambda download: tvd.Caltech101(r, target_type="category", download=download),
        root,
        download,
        f"{r}/caltech101/101_ObjectCategories/<class>/*.jpg",
    )
    keep_classes = [c for c in ds.categories if c not in CALTECH_IGNORED]
    old_to_new = {ds.categories.index(c): i for i, c in enumerate(keep_classes)}
    labels = _labels_of(ds)
    keep = np.flatnonzero(np.isin(labels, list(old_to_new)))
    new_labels = np.array([old_to_new[int(labels[i])] for i in keep])
    base = DatasetSource(ds, labels, "caltech101/all")
    tr, te = stratified_split(new_labels, test_fraction, seed=0)
    names = [_clean(CALTECH_RENAMED.get(c, c)).lower() for c in keep_classes]
    return DatasetSplits(
        name,
        names,
        SubsetSource(base, keep[tr], new_labels[tr], f"caltech101/tf{test_fraction}/train"),
        SubsetSource(base, keep[te], new_labels[te], f"caltech101/tf{test_fraction}/test"),
    )


def _official(name: str, root: Path, download: bool, test_fraction: float) -> DatasetSplits:
    """A torchvision dataset with its official train and test splits."""
    import torchvision.datasets as tvd

    r = str(root)
    official = {
        "oxford-pets": (
            lambda s, d: tvd.OxfordIIITPet(r, split=s, target_types="category", download=d),
            ("trainval", "test"),
            f"{r}/oxford-iiit-pet/images/*.jpg + annotations/",
        ),
        "flowers102": (
            lambda s, d: tvd.Flowers102(r, split=s, download=d),
            ("train", "test"),
            f"{r}/flowers-102/jpg/*.jpg + imagelabels.mat + setid.mat",
        ),
        "food101": (
            lambda s, d: tvd.Food101(r, split=s, download=d),
            ("train", "test"),
            f"{r}/food-101/images/<class>/*.jpg + meta/",
        ),
        "dtd": (
            lambda s, d: tvd.DTD(r, split=s, partition=1, download=d),
            ("train", "test"),
            f"{r}/dtd/dtd/images/<class>/*.jpg + labels/",
        ),
    }
    if name not in official:
        raise DataSetupError(f"unknown torchvision dataset {name!r}")
    factory, (s_train, s_test), expected = official[name]
    train = _open(name, lambda download: factory(s_train, download), root, download, expected)
    test = _open(name, lambda download: factory(s_test, download), root, download, expected)
    classnames = [_clean(c) for c in train.classes]
    return DatasetSplits(
        name,
        classnames,
        DatasetSource(train, _labels_of(train), f"{name}/{s_train}"),
        DatasetSource(test, _labels_of(test), f"{name}/{s_test}"),
    )


# --- image folders --------------------------------------------------------------------------


def _scan_class_dirs(root: Path) -> dict[str, list[Path]]:
    classes = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = sorted(f for f in d.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS)
        for f in (d, *files):
            try:
                str(f).encode("utf-8")
            except UnicodeEncodeError as err:  # a name in another encoding: it cannot be keyed, cached or reported
                raise DatasetError(
                    f"image folder {str(root)!r}: the name {bytes(f)!r} is not UTF-8: rename it (e.g. convmv -f latin1 "
                    "-t utf8)"
                ) from err
        classes[d.name] = files
    return classes


def _federation_classes(root: Path, found: list[str]) -> list[str]:
    """The class list, in label order. Organisations in one federation rarely hold every class:
    a ``classes.txt`` (one class folder name per line, the same file on every node) fixes the
    full list and its order, so that label i means the same class everywhere. Without it the
    folder's own sub-folders, sorted, are the classes."""
    listing = root / "classes.txt"
    if not listing.is_file():
        return found
    text = read_utf8(listing, "save it as UTF-8 (the same file on every node)")
    names = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if not names or dupes:
        raise DataSetupError(
            f"{listing} must list each class once, one per line ("
            f"{'it is empty' if not names else 'repeated: ' + ', '.join(dupes[:5])})"
        )
    unknown = [c for c in found if c not in names]
    if unknown:
        raise DatasetError(
            f"image folder {str(root)!r} has class folder(s) {', '.join(unknown[:5])} that "
            f"{listing.name} does not list: add them to the federation's class list (the same "
            f"file on every node) or rename the folders"
        )
    return names


def load_image_folder_request(request: catalogue.Request) -> DatasetSplits:
    return load_image_folder(Path(request.data_root), request.test_fraction)


def load_image_folder(root: Path, test_fraction: float) -> DatasetSplits:
    root = Path(root)
    if not root.is_dir():
        raise DataSetupError(
            f"image folder {str(root)!r} does not exist; it must hold one sub-folder per class "
            "(<root>/<class name>/<image>.jpg)"
        )
    has_split = (root / "train").is_dir() and (root / "test").is_dir()
    trees = {s: _scan_class_dirs(root / s) for s in ("train", "test")} if has_split else {"all": _scan_class_dirs(root)}
    found = sorted(set().union(*[t.keys() for t in trees.values()]))
    if not found:
        raise DataSetupError(
            f"image folder {str(root)!r} has no class sub-folders; expected <root>/<class name>/<image>.jpg"
        )
    names = _federation_classes(root, found)
    for split, tree in trees.items():
        empty = [c for c, files in tree.items() if not files]
        if empty:
            raise DatasetError(
                f"image folder {str(root / split) if has_split else str(root)!r}: class folder(s) "
                f"{', '.join(empty[:5])} hold no images ({', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
    index = {c: i for i, c in enumerate(names)}

    def source(tree, tag):
        paths = [p for c in names for p in tree.get(c, [])]
        labels = np.array([index[c] for c in names for _ in tree.get(c, [])], dtype=np.int64)
        return FileSource(paths, labels, f"folder:{root.name}:{len(paths)}/{tag}")

    if has_split:
        train, test = source(trees["train"], "train"), source(trees["test"], "test")
    else:
        full = source(trees["all"], "all")
        tr, te = stratified_split(full.labels, test_fraction, seed=0)
        train = SubsetSource(full, tr, full.labels[tr], f"{full.identity}/tf{test_fraction}/train")
        test = SubsetSource(full, te, full.labels[te], f"{full.identity}/tf{test_fraction}/test")
    return DatasetSplits("image-folder", [_clean(c) for c in names], train, test)


# MedMNIST's BloodMNIST label names, in label order
BLOODMNIST_CLASSES = [
    "basophil",
    "eosinophil",
    "erythroblast",
    "immature granulocytes",
    "lymphocyte",
    "monocyte",
    "neutrophil",
    "platelet",
]


def load_bloodmnist(request: catalogue.Request) -> DatasetSplits:
    """BloodMNIST (Reprogrammable-FL's medical task): MedMNIST's ``bloodmnist.npz`` (or any of its
    ``bloodmnist_<size>.npz`` variants) under data-root, with its official train/test split; or
    the same images as an image folder (<root>/<class>/*.png, optionally train/ and test/)."""
    root, test_fraction = Path(request.data_root), request.test_fraction
    files = sorted(root.glob("bloodmnist*.npz")) if root.is_dir() else []
    if not files:
        if root.is_dir() and any(p.is_dir() for p in root.iterdir()):
            splits = load_image_folder(root, test_fraction)
            splits.name = "bloodmnist"
            return splits
        raise DataSetupError(
            f"BloodMNIST not found under {str(root)!r}: put MedMNIST's bloodmnist.npz there "
            "(https://zenodo.org/records/10519652, or `pip install medmnist` and its download) or an "
            "image folder <root>/<class>/*.png"
        )
    with np.load(files[0]) as z:
        missing = [k for k in ("train_images", "train_labels", "test_images", "test_labels") if k not in z]
        if missing:
            raise DatasetError(f"{files[0]} lacks {', '.join(missing)}: is it a MedMNIST file?")
        parts = {k: z[k] for k in ("train_images", "train_labels", "test_images", "test_labels")}

    def rgb(images: np.ndarray) -> np.ndarray:
        return np.repeat(images[..., None], 3, axis=-1) if images.ndim == 3 else images

    tag = f"bloodmnist:{files[0].name}"
    return DatasetSplits(
        "bloodmnist",
        list(BLOODMNIST_CLASSES),
        ArraySource(rgb(parts["train_images"]), parts["train_labels"].reshape(-1).astype(np.int64), f"{tag}/train"),
        ArraySource(rgb(parts["test_images"]), parts["test_labels"].reshape(-1).astype(np.int64), f"{tag}/test"),
    )


TORCHVISION_SETS = catalogue.TORCHVISION


def load_dataset(
    name: str,
    data_root: str = "",
    download: bool = False,
    test_fraction: float = 0.3,
    max_per_class: int = 0,
    seed: int = 0,
    embedded_per_class: int = 0,
) -> DatasetSplits:
    """Load a catalogued image-classification dataset by name (see the module docstring)."""
    try:
        entry = catalogue.get_dataset(name, image_text=False)
    except ValueError as err:
        raise DatasetError(str(err)) from None
    request = catalogue.Request(name, data_root, download, test_fraction, embedded_per_class=embedded_per_class)
    splits = load(entry.loader)(request)
    splits.train = limit_per_class(splits.train, max_per_class, seed, lambda i: f"{i}/max{max_per_class}-s{seed}")
    return splits
