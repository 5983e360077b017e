"""Every dataset a run can name, with the facts the config checks and the loaders read: one
torch-free catalogue, so that the schema's choices, the data-root rule, the family check, the
membership attack's shadow data and the loaders' dispatch cannot disagree. A new dataset is one
entry here and its loader.

Each entry names its loader by path (``'package.module:function'``, imported only where data is
loaded: this module is read by every config check); a loader takes the entry's ``Request``. The
loaders themselves are in ``data.registry`` (image classification) and ``data.vlm_data`` (captions
and VQA); what a dataset's files look like is in ``docs/configuration.md``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """What a loader is asked for: the dataset's name and the run config's data keys."""

    name: str
    data_root: str = ""
    download: bool = False
    test_fraction: float = 0.3
    max_train: int = 0  # image-text sets: at most this many training records (0: all)
    embedded_per_class: int = 0  # the embedded image sets: training images per class (0: their default)
    max_test: int = 0
    ood_captions: str = ""  # coco-captions: a second caption file for the out-of-domain split
    hf_dataset: str = ""  # scienceqa: the hub dataset when data-root is empty


@dataclass(frozen=True)
class Dataset:
    name: str
    loader: str  # 'module:function' of a Request -> the splits (data.sources.DatasetSplits or a VLMDataset)
    image_text: bool = False  # captions or VQA (the VLM methods' family) rather than image classification
    root: str = ""  # 'required': its files are under data-root; 'optional': there or from its hub; '': made in-process
    torchvision: bool = False  # loaded through torchvision's class of the same layout
    # an independent draw of the same task, disjoint from it: the data a membership attacker
    # trains its shadow federations on (attacks.run); '' where there is none built in
    shadow: str = ""

    @property
    def made_here(self) -> bool:
        """Generated in-process or shipped with a package: runs offline, nothing under data-root."""
        return self.root == ""


_IMAGES, _VLM = "fedvlm.data.registry", "fedvlm.data.vlm_data"
CATALOGUE: tuple[Dataset, ...] = (
    Dataset("embedded", f"{_IMAGES}:load_embedded", shadow="embedded-shadow"),
    Dataset("embedded-shadow", f"{_IMAGES}:load_embedded"),
    Dataset("digits", f"{_IMAGES}:load_digits"),
    Dataset("motifs", f"{_IMAGES}:load_motifs"),
    *(
        Dataset(name, f"{_IMAGES}:load_torchvision", root="required", torchvision=True)
        for name in ("caltech101", "oxford-pets", "flowers102", "food101", "dtd", "cifar10", "cifar100")
    ),
    Dataset("image-folder", f"{_IMAGES}:load_image_folder_request", root="required"),
    Dataset("bloodmnist", f"{_IMAGES}:load_bloodmnist", root="required"),
    Dataset("embedded-captions", f"{_VLM}:load_embedded", image_text=True),
    Dataset("embedded-captions-varied", f"{_VLM}:load_embedded", image_text=True),
    Dataset("embedded-vqa", f"{_VLM}:load_embedded", image_text=True),
    Dataset("coco-captions", f"{_VLM}:load_coco", image_text=True, root="required"),
    Dataset("scienceqa", f"{_VLM}:load_scienceqa", image_text=True, root="optional"),
)
BY_NAME = {d.name: d for d in CATALOGUE}

NAMES = tuple(BY_NAME)
IMAGE_TEXT = frozenset(d.name for d in CATALOGUE if d.image_text)
NEEDING_ROOT = frozenset(d.name for d in CATALOGUE if d.root == "required")
OPTIONAL_ROOT = frozenset(d.name for d in CATALOGUE if d.root == "optional")
TORCHVISION = tuple(d.name for d in CATALOGUE if d.torchvision)
EMBEDDED_CLASSIFICATION = frozenset(d.name for d in CATALOGUE if d.made_here and not d.image_text)


def get_dataset(name: str, image_text: bool) -> Dataset:
    """The entry of ``name``, one of the family's kind (image-text or image classification)."""
    entry = BY_NAME.get(name)
    if entry is None or entry.image_text != image_text:
        kind = [d.name for d in CATALOGUE if d.image_text == image_text]
        raise ValueError(f"unknown dataset {name!r} for this family; accepted: {', '.join(kind)}")
    return entry
