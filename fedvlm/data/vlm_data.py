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

An organisation's own data (a node config's ``data-dir``, ``load_vlm_folder``): images plus
one ``data.jsonl`` of records, for the task of the run's dataset::

    {"image": "images/0001.jpg", "caption": "a dog on a sofa"}                  captioning
    {"image": "images/0002.jpg", "captions": ["a dog on a sofa", "a brown dog"]}  several references
    {"image": "images/0003.jpg", "question": "What colour is the dog?",
     "choices": ["brown", "white"], "answer": "brown"}                            multiple choice

each optionally with ``"label"`` (its class or topic: the split label, used only to describe the
data) and ``"split"`` (``"train"`` or ``"test"``; without one, a seeded per-label split by
``test-fraction``); an optional ``labels.txt`` fixes the label names and their order. The prompt
a record trains with is the run dataset's (``FOLDER_PROMPTS``), so own-data nodes and partition
nodes of one federation learn the same task.

Every split is a ``VLMSplit``: an ``ImageSource`` (labels = split label) and three parallel
lists: prompts, training targets and reference answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedvlm.data import scenes
from fedvlm.data.sources import ArraySource, FileSource, ImageSource, SubsetSource, stratified_split
from fedvlm.runconfig.datasets import Request, get_dataset
from fedvlm.utils.files import load_json, read_utf8
from fedvlm.utils.imports import load

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


def load_embedded(request: Request) -> VLMDataset:
    """The scenes domain's task ``request.name`` names (``EMBEDDED_TASKS``)."""
    name = request.name
    task = EMBEDDED_TASKS[name]
    base = 40_000
    tag = f"scenes-{task}"
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
    blob = load_json(instances, "download the COCO-style annotation file again")
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
    blob = load_json(captions_json, "download the COCO-style caption file again")
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


def load_coco(request: Request) -> VLMDataset:
    root, ood_captions, max_train, max_test = (
        Path(request.data_root),
        request.ood_captions,
        request.max_train,
        request.max_test,
    )
    ann = root / "annotations"
    train, names = load_coco_style(ann / "captions_train2017.json", root / "train2017", "coco/train", max_train)
    test, _ = load_coco_style(ann / "captions_val2017.json", root / "val2017", "coco/val", max_test)
    ood = None
    if ood_captions:
        p = Path(ood_captions)
        ood, _ = load_coco_style(p, p.parent / "images", f"ood:{p.name}", max_test)
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


def load_scienceqa(request: Request) -> VLMDataset:
    """ScienceQA from a folder ``datasets`` saved (data-root), or from its hub (hf-dataset)."""
    import datasets

    source, max_train, max_test = request.data_root or request.hf_dataset, request.max_train, request.max_test
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


# --- an organisation's own folder -------------------------------------------------------------
FOLDER_FILE, FOLDER_LABELS = "data.jsonl", "labels.txt"
UNLABELLED = "unlabelled"


def _scenes_vqa(question: str, choices: list[str], hint: str) -> str:
    return scenes.vqa_prompt(question, choices)


# the run's dataset -> (task, the captioning prompt, how a multiple-choice record becomes a prompt)
FOLDER_PROMPTS = {
    "embedded-captions": ("caption", scenes.CAPTION_PROMPT, _scenes_vqa),
    "embedded-captions-varied": ("caption", scenes.CAPTION_PROMPT, _scenes_vqa),
    "coco-captions": ("caption", CAPTION_PROMPT_REAL, scienceqa_prompt),
    "embedded-vqa": ("vqa", scenes.CAPTION_PROMPT, _scenes_vqa),
    "scienceqa": ("vqa", CAPTION_PROMPT_REAL, scienceqa_prompt),
}


def _answer_letter(record: dict, where: str) -> str:
    choices, answer = record["choices"], record["answer"]
    if isinstance(answer, int) and 0 <= answer < len(choices):
        return "ABCDE"[answer]
    if isinstance(answer, str) and answer in choices:
        return "ABCDE"[choices.index(answer)]
    if isinstance(answer, str) and len(answer) == 1 and "A" <= answer <= "ABCDE"[len(choices) - 1]:
        return answer
    raise VLMDataError(f"{where}: 'answer' {answer!r} is neither one of its choices, their index, nor their letter")


def _folder_row(line: str, where: str, root: Path, dataset: str) -> tuple:
    """One record of an own folder (``where``: its file and line) as (image, prompt, target,
    references, label, split), checked against the task ``dataset`` trains."""
    task, caption_prompt, vqa_prompt = FOLDER_PROMPTS[dataset]
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise VLMDataError(f"{where} is not JSON: {err}") from err
    if not isinstance(record, dict) or not isinstance(record.get("image"), str):
        raise VLMDataError(f"{where}: each record needs an 'image' path (relative to {root})")
    image = root / record["image"]
    if not image.is_file():
        raise VLMDataError(f"{where}: image {image} does not exist")
    if task == "caption":
        refs = record.get("captions") or ([record["caption"]] if record.get("caption") else [])
        if not refs or not all(isinstance(r, str) and r.strip() for r in refs):
            raise VLMDataError(f"{where}: the run trains captioning ({dataset}); give 'caption' or 'captions'")
        prompt, target, refs = caption_prompt, refs[0].strip(), [r.strip() for r in refs]
    else:
        if not {"question", "choices", "answer"} <= set(record) or not record["choices"]:
            raise VLMDataError(
                f"{where}: the run trains multiple-choice answering ({dataset}); give 'question', 'choices' "
                "and 'answer'"
            )
        prompt = vqa_prompt(record["question"], record["choices"], record.get("hint", ""))
        target = _answer_letter(record, where)
        refs = [target]
    split = record.get("split", "")
    if split not in ("", "train", "test"):
        raise VLMDataError(f"{where}: 'split' is {split!r}; use 'train' or 'test' (or leave it out)")
    return image, prompt, target, refs, str(record.get("label", UNLABELLED)), split


def load_vlm_folder(root: Path, dataset: str, test_fraction: float, seed: int) -> VLMDataset:
    """An organisation's own folder (the module docstring) for a run on ``dataset``."""
    root = Path(root).expanduser()
    records_path = root / FOLDER_FILE
    if not records_path.is_file():
        raise VLMDataError(
            f"{records_path} does not exist: an own-data VLM folder holds its images and a {FOLDER_FILE} with one "
            '{"image": ..., "caption": ...} (or "question"/"choices"/"answer") record per line; '
            "python -m fedvlm.deploy.export_folder --set method=fedrand writes examples"
        )
    task = FOLDER_PROMPTS[dataset][0]
    rows = []
    for n, line in enumerate(read_utf8(records_path, f"save {FOLDER_FILE} as UTF-8").splitlines(), 1):
        if line.strip():
            rows.append(_folder_row(line, f"{records_path} line {n}", root, dataset))
    if not rows:
        raise VLMDataError(f"{records_path} holds no records")
    names_file = root / FOLDER_LABELS
    names = (
        [x.strip() for x in read_utf8(names_file, "save it as UTF-8").splitlines() if x.strip()]
        if names_file.is_file()
        else sorted({r[4] for r in rows})
    )
    unknown = sorted({r[4] for r in rows} - set(names))
    if unknown:
        raise VLMDataError(f"labels {unknown} are not in {names_file}: add them there or fix the records")
    labels = np.array([names.index(r[4]) for r in rows], dtype=np.int64)
    if any(r[5] for r in rows):
        train_idx = np.array([i for i, r in enumerate(rows) if r[5] != "test"], dtype=np.int64)
        test_idx = np.array([i for i, r in enumerate(rows) if r[5] == "test"], dtype=np.int64)
    else:
        train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    everything = VLMSplit(
        FileSource([r[0] for r in rows], labels, f"own-vlm-folder:{root.name}"),
        [r[1] for r in rows],
        [r[2] for r in rows],
        [r[3] for r in rows],
    )
    return VLMDataset(
        f"own:{root.name}", task, names, everything.subset(train_idx, "train"), everything.subset(test_idx, "test")
    )


def load_vlm_dataset(
    name: str, data_root: str = "", ood_captions: str = "", max_train: int = 0, max_test: int = 0, hf_dataset: str = ""
) -> VLMDataset:
    """Load a catalogued image-text dataset by name."""
    try:
        entry = get_dataset(name, image_text=True)
    except ValueError as err:
        raise VLMDataError(str(err)) from None
    request = Request(
        name, data_root, max_train=max_train, max_test=max_test, ood_captions=ood_captions, hf_dataset=hf_dataset
    )
    ds = load(entry.loader)(request)
    if max_train and len(ds.train) > max_train:
        ds.train = ds.train.subset(np.arange(max_train), f"first{max_train}")
    return ds
