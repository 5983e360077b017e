"""Datasets of the VLM methods: (image, prompt, target) triples with references and a split label.

- ``embedded-captions`` / ``embedded-vqa``: the generated scenes domain (``data.scenes``),
  offline; the captions set carries an out-of-domain split of unseen shape pairs.
- ``coco-captions``: a COCO-style captions JSON plus its image folder under data-root
  (``annotations/captions_{train,val}2017.json``, ``train2017/``, ``val2017/``); the split
  label is the category of each image's largest object when ``instances_*.json`` sits beside
  the captions (the paper's Dirichlet split by object class), else 0. A NoCaps-style OOD set
  is any other COCO-style captions JSON, named by ``vlm.ood-captions``.
- ``scienceqa``: multiple-choice questions with images, from a local copy of the Hugging Face
  dataset (``datasets.load_from_disk`` directory or a hub id in ``vlm.hf-dataset``); the split
  label is the topic. Questions without an image are dropped (the paper's image subset).

Every split is a ``VLMSplit``: an ``ImageSource`` (labels = split label) and three parallel
lists: prompts, training targets and reference answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedvlm.data import scenes
from fedvlm.data.sources import ArraySource, FileSource, ImageSource, SubsetSource

EMBEDDED_SIZES = {"train": 1200, "test": 240, "ood": 240}


class VLMDataError(ValueError):
    """A VLM dataset that cannot be loaded; the message says what is missing and how to fix it."""


@dataclass
class VLMSplit:
    images: ImageSource
    prompts: list[str]
    targets: list[str]
    references: list[list[str]]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def labels(self) -> np.ndarray:
        return self.images.labels

    def subset(self, idx: np.ndarray, tag: str) -> VLMSplit:
        idx = np.asarray(idx, dtype=np.int64)
        return VLMSplit(
            SubsetSource(self.images, idx, self.images.labels[idx], f"{self.images.identity}/{tag}"),
            [self.prompts[i] for i in idx],
            [self.targets[i] for i in idx],
            [self.references[i] for i in idx],
        )


@dataclass
class VLMDataset:
    name: str
    task: str  # "caption" | "vqa"
    label_names: list[str]  # what the split label means (object class, topic)
    train: VLMSplit
    test: VLMSplit
    ood: VLMSplit | None = None

    @property
    def n_labels(self) -> int:
        return len(self.label_names)


def _from_corpus(corpus: scenes.SceneCorpus, identity: str) -> VLMSplit:
    return VLMSplit(
        ArraySource(corpus.images, corpus.labels, identity), corpus.prompts, corpus.targets, corpus.references
    )


EMBEDDED_TASKS = {"embedded-captions": "caption", "embedded-captions-varied": "caption-varied", "embedded-vqa": "vqa"}


def load_embedded(name: str, shadow: bool = False) -> VLMDataset:
    """The scenes domain (``EMBEDDED_TASKS``); ``shadow``: an independent draw (data a membership
    attacker owns)."""
    task = EMBEDDED_TASKS[name]
    base = 50_000 if shadow else 40_000
    tag = f"scenes-{task}{'-shadow' if shadow else ''}"
    train = _from_corpus(scenes.generate(task, EMBEDDED_SIZES["train"], base + 1), f"{tag}/train")
    test = _from_corpus(scenes.generate(task, EMBEDDED_SIZES["test"], base + 2), f"{tag}/test")
    ood = None
    captions = task != "vqa"
    if captions:
        ood = _from_corpus(scenes.generate(task, EMBEDDED_SIZES["ood"], base + 3, ood=True), f"{tag}/ood")
    labels = list(scenes.SHAPES) if captions else list(scenes.TOPICS)
    return VLMDataset(name, "caption" if captions else "vqa", labels, train, test, ood)


# --- COCO-style captions ---------------------------------------------------------------------
def _largest_category(instances: Path) -> tuple[dict[int, int], list[str]]:
    blob = json.loads(instances.read_text())
    names = {c["id"]: c["name"] for c in blob["categories"]}
    order = sorted(names)
    best: dict[int, tuple[float, int]] = {}
    for a in blob["annotations"]:
        if a["image_id"] not in best or a["area"] > best[a["image_id"]][0]:
            best[a["image_id"]] = (a["area"], order.index(a["category_id"]))
    return {k: v[1] for k, v in best.items()}, [names[c] for c in order]


CAPTION_PROMPT_REAL = "Write a short caption for this image."
# the split label of an image COCO's instances file annotates no object in (not 'person', index 0)
NO_OBJECT = "no annotated object"


def load_coco_style(
    captions_json: Path, image_dir: Path, identity: str, max_images: int = 0, prompt: str = CAPTION_PROMPT_REAL
) -> tuple[VLMSplit, list[str]]:
    if not captions_json.is_file():
        raise VLMDataError(
            f"captions file {captions_json} does not exist: download the COCO (or NoCaps) captions "
            "annotations and point data-root (or vlm.ood-captions) at them"
        )
    if not image_dir.is_dir():
        raise VLMDataError(f"image folder {image_dir} for {captions_json.name} does not exist")
    blob = json.loads(captions_json.read_text())
    caps: dict[int, list[str]] = {}
    for a in blob["annotations"]:
        caps.setdefault(a["image_id"], []).append(a["caption"].strip())
    images = [im for im in sorted(blob["images"], key=lambda im: im["id"]) if im["id"] in caps]
    if max_images:
        images = images[:max_images]
    label_of: dict[int, int] = {}
    label_names = ["image"]
    inst = captions_json.with_name(captions_json.name.replace("captions_", "instances_"))
    unlabelled = 0
    if inst != captions_json and inst.is_file():
        label_of, names = _largest_category(inst)
        label_names = [*names, NO_OBJECT]
        unlabelled = len(names)
    labels = np.array([label_of.get(im["id"], unlabelled) for im in images], dtype=np.int64)
    paths = [image_dir / im["file_name"] for im in images]
    refs = [caps[im["id"]] for im in images]
    split = VLMSplit(FileSource(paths, labels, identity), [prompt] * len(images), [r[0] for r in refs], refs)
    return split, label_names


def load_coco(root: Path, ood_captions: str = "", max_train: int = 0, max_test: int = 0) -> VLMDataset:
    ann = root / "annotations"
    train, names = load_coco_style(ann / "captions_train2017.json", root / "train2017", f"coco:{root}/train", max_train)
    test, _ = load_coco_style(ann / "captions_val2017.json", root / "val2017", f"coco:{root}/val", max_test)
    ood = None
    if ood_captions:
        p = Path(ood_captions)
        ood, _ = load_coco_style(p, p.parent / "images", f"ood:{p}", max_test)
    return VLMDataset("coco-captions", "caption", names, train, test, ood)


# --- ScienceQA-style multiple choice -------------------------------------------------------------
def scienceqa_prompt(question: str, choices: list[str], hint: str = "") -> str:
    """LLaVA's ScienceQA format: context, question, lettered options, answer with the letter."""
    opts = "\n".join(f"{'ABCDE'[i]}. {c}" for i, c in enumerate(choices))
    context = f"Context: {hint}\n" if hint else ""
    return f"{context}{question}\n{opts}\nAnswer with the option's letter from the given choices directly."


class _HFImages(ImageSource):
    def __init__(self, rows, labels: np.ndarray, identity: str):
        self.rows = rows
        self.labels = labels
        self.identity = identity

    def image(self, i: int):
        return self.rows[int(i)]["image"].convert("RGB")

    def _hash_content(self, h) -> None:
        h.update(self.rows._fingerprint.encode())  # the datasets library's hash of the rows' content


def load_scienceqa(source: str, max_train: int = 0, max_test: int = 0) -> VLMDataset:
    import datasets

    try:
        if Path(source).expanduser().is_dir():
            ds = datasets.load_from_disk(str(Path(source).expanduser()))
        else:
            ds = datasets.load_dataset(source)
    except Exception as err:  # datasets raises many types for a missing/offline dataset
        raise VLMDataError(
            f"ScienceQA could not be loaded from {source!r} ({type(err).__name__}: {err}); on a machine with network "
            'run `python -c "import datasets; '
            "datasets.load_dataset('derek-thomas/ScienceQA').save_to_disk('scienceqa')\"` "
            "and set data-root to that directory"
        ) from err
    topics: list[str] = sorted({t for split in ("train", "test") for t in ds[split]["topic"]})

    def split(name: str, limit: int) -> VLMSplit:
        rows = ds[name]
        keep = [i for i, im in enumerate(rows["image"]) if im is not None]
        if limit:
            keep = keep[:limit]
        rows = rows.select(keep)
        labels = np.array([topics.index(t) for t in rows["topic"]], dtype=np.int64)
        prompts = [
            scienceqa_prompt(q, c, h) for q, c, h in zip(rows["question"], rows["choices"], rows["hint"], strict=True)
        ]
        answers = ["ABCDE"[a] for a in rows["answer"]]
        return VLMSplit(_HFImages(rows, labels, f"scienceqa:{source}/{name}"), prompts, answers, [[a] for a in answers])

    return VLMDataset("scienceqa", "vqa", topics, split("train", max_train), split("test", max_test))


def load_vlm_dataset(
    name: str, data_root: str = "", ood_captions: str = "", max_train: int = 0, max_test: int = 0, hf_dataset: str = ""
) -> VLMDataset:
    if name.removesuffix("-shadow") in EMBEDDED_TASKS:
        ds = load_embedded(name.removesuffix("-shadow"), shadow=name.endswith("-shadow"))
    elif name == "coco-captions":
        ds = load_coco(Path(data_root), ood_captions, max_train, max_test)
    elif name == "scienceqa":
        ds = load_scienceqa(data_root or hf_dataset, max_train, max_test)
    else:
        raise VLMDataError(f"{name!r} is not a VLM dataset")
    if max_train and len(ds.train) > max_train:
        ds.train = ds.train.subset(np.arange(max_train), f"first{max_train}")
    return ds
