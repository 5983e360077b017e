"""Loading a frozen CLIP backbone: open_clip name + pretrained tag, a local checkpoint, or the
embedded tiny CLIP.

``load_clip`` returns a ``ClipBundle``: the frozen model, its tokenizer, the image
preprocess, and a fingerprint that names the exact weights (it keys the feature cache and
lets the server check that every client runs the same backbone).

Offline behaviour: a pretrained tag is looked up in the local Hugging Face cache first; if
it is not there and huggingface.co cannot be reached, loading fails at once (no minute of
retries) with a message saying how to supply the weights as a local file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from fedvlm.models import tiny_clip

log = logging.getLogger(__name__)


class BackboneError(RuntimeError):
    """A backbone that cannot be loaded; the message says how to fix it."""


@dataclass
class ClipBundle:
    model: nn.Module  # frozen, eval mode
    tokenizer: Callable
    preprocess: Callable[[Image.Image], torch.Tensor]  # eval transform
    augment: Callable[[Image.Image], torch.Tensor]  # training transform with random crop/flip
    name: str
    pretrained: str
    fingerprint: str
    device: torch.device
    embed_dim: int

    @property
    def logit_scale(self) -> float:
        scale = self.model.logit_scale
        assert isinstance(scale, torch.Tensor)  # open_clip's learned temperature, a Parameter
        return float(scale.exp())


def _hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _hf_offline():
    """Make huggingface_hub use only its local cache (it otherwise retries for a minute)."""
    from huggingface_hub import constants

    old = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = old


_FINGERPRINTS: dict[tuple[str, int, float], str] = {}


def file_fingerprint(path: Path) -> str:
    """sha256 of a checkpoint file (content, so that two machines agree), memoised per
    (path, size, mtime) because hashing a ViT-L checkpoint takes seconds."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime)
    if key not in _FINGERPRINTS:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        _FINGERPRINTS[key] = f"sha256:{h.hexdigest()[:16]}:{stat.st_size}"
    return _FINGERPRINTS[key]


def _tiny_preprocess(img: Image.Image) -> torch.Tensor:
    if img.size != (tiny_clip.embedded.IMAGE_SIZE,) * 2:
        img = img.resize((tiny_clip.embedded.IMAGE_SIZE,) * 2, Image.Resampling.BICUBIC)
    return tiny_clip.to_tensor(np.asarray(img.convert("RGB"))[None])[0]


def _tiny_augment(img: Image.Image) -> torch.Tensor:
    from torchvision.transforms import v2

    x = _tiny_preprocess(img)
    aug = v2.Compose(
        [
            v2.RandomResizedCrop(tiny_clip.embedded.IMAGE_SIZE, scale=(0.6, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    )
    return aug(x)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BackboneError("run config 'device' = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(name)


def _load_open_clip(name: str, pretrained: str, cache_dir: Path):
    import open_clip

    if name not in open_clip.list_models():
        raise BackboneError(
            f"run config 'clip.model' = {name!r} is not an open_clip architecture nor 'embedded-tiny'; "
            f"examples: ViT-B-16, ViT-B-32, RN50, ViT-L-14 (`open_clip.list_models()` lists all)"
        )
    if not pretrained:
        log.warning("clip.pretrained is empty: %s is RANDOMLY INITIALISED (benchmarks only)", name)
        model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None)
        return model, preprocess, open_clip.get_tokenizer(name), f"{name}:random-init"
    path = Path(pretrained).expanduser()
    looks_like_path = os.sep in pretrained or path.suffix in {".bin", ".pt", ".pth", ".safetensors"}
    if looks_like_path:
        if not path.is_file():
            raise BackboneError(
                f"run config 'clip.pretrained' = {pretrained!r} looks like a file path but no such "
                "file exists on this machine"
            )
        model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=str(path))
        return model, preprocess, open_clip.get_tokenizer(name), f"{name}:{file_fingerprint(path)}"
    tags = open_clip.list_pretrained_tags_by_model(name)
    if pretrained not in tags:
        raise BackboneError(
            f"run config 'clip.pretrained' = {pretrained!r} is neither a pretrained tag of {name} "
            f"({', '.join(tags) or 'none'}) nor an existing checkpoint file"
        )
    online = _hub_reachable()
    try:
        with contextlib.nullcontext() if online else _hf_offline():
            model, _, preprocess = open_clip.create_model_and_transforms(
                name, pretrained=pretrained, cache_dir=str(cache_dir / "open_clip") if cache_dir else None
            )
    except Exception as err:
        where = (
            "the download failed"
            if online
            else "this machine cannot reach huggingface.co and they are not in the local cache"
        )
        raise BackboneError(
            f"weights for {name} / {pretrained} could not be loaded: {where} ({err}). Supply them "
            f'as a local file: on a machine with network run `python -c "import open_clip; '
            f"open_clip.create_model('{name}', pretrained='{pretrained}', cache_dir='weights')\"`, copy "
            f"the open_clip_pytorch_model.bin it saves here, and set clip.pretrained='/path/to/that/file'"
        ) from err
    return model, preprocess, open_clip.get_tokenizer(name), f"{name}:{pretrained}"


_CACHE: dict[tuple, ClipBundle] = {}


def load_clip(name: str, pretrained: str, cache_dir: Path, device: str = "auto") -> ClipBundle:
    """The frozen backbone; loaded once per process (simulated clients share a process)."""
    dev = resolve_device(device)
    key = (name, pretrained, str(cache_dir), str(dev))
    if key in _CACHE:
        return _CACHE[key]
    if name == tiny_clip.EMBEDDED_MODEL_NAME:
        model, path = tiny_clip.load_embedded_clip(Path(cache_dir))
        bundle_parts = (
            model,
            _tiny_preprocess,
            _tiny_augment,
            tiny_clip.tokenizer(),
            f"{name}:{tiny_clip.PretrainRecipe().key()}",
        )
        pretrained = "embedded (pretrained on the embedded domain at first use)"
    else:
        model, preprocess, tok, fp = _load_open_clip(name, pretrained, Path(cache_dir))
        bundle_parts = (model, preprocess, _open_clip_augment(model, preprocess), tok, fp)
    model, preprocess, augment, tok, fp = bundle_parts
    model = model.to(dev).eval().requires_grad_(False)
    with torch.no_grad():
        embed_dim = int(model.encode_text(tok(["a"]).to(dev)).shape[-1])
    bundle = ClipBundle(model, tok, preprocess, augment, name, pretrained, fp, dev, embed_dim)
    _CACHE[key] = bundle
    return bundle


def _open_clip_augment(model, preprocess):
    """CoOp's training transform: random resized crop + flip, then the model's normalisation."""
    import open_clip

    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    norm = next((t for t in getattr(preprocess, "transforms", []) if type(t).__name__ == "Normalize"), None)
    mean = tuple(norm.mean) if norm is not None else None
    std = tuple(norm.std) if norm is not None else None
    return open_clip.image_transform(size, is_train=True, mean=mean, std=std)
