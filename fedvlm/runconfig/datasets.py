"""Every dataset a run can name, with the facts the config checks and the loaders read: one
torch-free catalogue, so that the schema's choices, the data-root rule, the family check and the
loaders' dispatch cannot disagree.

The loaders themselves are in ``data.registry`` (image classification) and ``data.vlm_data``
(captions and VQA); what a dataset's files look like is in ``docs/configuration.md``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dataset:
    name: str
    image_text: bool = False  # captions or VQA (the VLM methods' family) rather than image classification
    root: str = ""  # 'required': its files are under data-root; 'optional': there or from its hub; '': made in-process
    torchvision: bool = False  # loaded through torchvision's class of the same layout


CATALOGUE: tuple[Dataset, ...] = (
    Dataset("embedded"),
    Dataset("embedded-shadow"),
    Dataset("digits"),
    Dataset("motifs"),
    *(
        Dataset(name, root="required", torchvision=True)
        for name in ("caltech101", "oxford-pets", "flowers102", "food101", "dtd", "cifar10", "cifar100")
    ),
    Dataset("image-folder", root="required"),
    Dataset("bloodmnist", root="required"),
    Dataset("embedded-captions", image_text=True),
    Dataset("embedded-captions-varied", image_text=True),
    Dataset("embedded-vqa", image_text=True),
    Dataset("coco-captions", image_text=True, root="required"),
    Dataset("scienceqa", image_text=True, root="optional"),
)
BY_NAME = {d.name: d for d in CATALOGUE}

NAMES = tuple(BY_NAME)
IMAGE_TEXT = frozenset(d.name for d in CATALOGUE if d.image_text)
NEEDING_ROOT = frozenset(d.name for d in CATALOGUE if d.root == "required")
OPTIONAL_ROOT = frozenset(d.name for d in CATALOGUE if d.root == "optional")
TORCHVISION = tuple(d.name for d in CATALOGUE if d.torchvision)
