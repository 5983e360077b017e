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
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from fedvlm.models import tiny_clip
from fedvlm.runconfig import weights_path

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


def tensor_fingerprint(model: nn.Module, activation: str) -> str:
    """What was loaded: a sha256 of every tensor of the model (names, dtypes, shapes, values),
    and the activation its MLPs compute, which no tensor holds. Two machines that load the same
    weights agree, whatever file, format or cache they came from; two different caches of one
    tag, or two random initialisations, do not."""
    h = hashlib.sha256(activation.encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return f"{activation}:sha256:{h.hexdigest()[:16]}"


def weights_fingerprint(name: str, model: nn.Module, activation: str) -> str:
    """A loaded CLIP's fingerprint, as every node reports it and results.json records it."""
    return f"{name}:{tensor_fingerprint(model, activation)}"


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


QUICK_GELU, GELU = "quick-gelu", "gelu"
OPENAI_CLIP_CACHE = Path("~/.cache/clip")  # where OpenAI's `clip` package keeps its TorchScript files


def is_torchscript(path: Path) -> bool:
    """OpenAI's original checkpoints (and the `clip` package's) are TorchScript archives: a zip
    holding compiled code, which torch.load(weights_only=True) refuses."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith(("constants.pkl", "/code/__torch__.py")) or "/code/" in n for n in z.namelist())


def activation_of(name: str, pretrained: str, path: Path | None) -> str:
    """The activation the weights were trained with: the architecture's own for a `-quickgelu`
    name; open_clip's pretrained config for a tag (OpenAI's are QuickGELU, though open_clip 3.x
    builds the plain name with GELU); for a file, the `open_clip_config.json` beside it (what a
    Hugging Face download leaves), else the name's. A file whose config contradicts a
    `-quickgelu` name is refused."""
    import json

    import open_clip

    named = QUICK_GELU if name.endswith("-quickgelu") else GELU
    if path is None:
        cfg = open_clip.get_pretrained_cfg(name, pretrained) if pretrained else {}
        return QUICK_GELU if cfg.get("quick_gelu") or named == QUICK_GELU else GELU
    beside = path.parent / "open_clip_config.json"
    if beside.is_file():
        quick = bool(json.loads(beside.read_text()).get("model_cfg", {}).get("quick_gelu", False))
        if named == QUICK_GELU and not quick:
            raise BackboneError(
                f"clip.model {name!r} computes QuickGELU but {beside} says its weights were trained with GELU: "
                f"use clip.model={name.removesuffix('-quickgelu')!r}"
            )
        return QUICK_GELU if quick else named
    return named


def _random_init(name: str, quick: bool):
    """Seeded: every process builds the same weights, so nodes agree on the fingerprint."""
    import open_clip

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return open_clip.create_model_and_transforms(name, pretrained=None, force_quick_gelu=quick)


def _load_torchscript(name: str, path: Path):
    """OpenAI's TorchScript checkpoint as an eager open_clip model (its state dict, QuickGELU)."""
    import open_clip

    model = open_clip.load_openai_model(str(path), device="cpu")
    size = model.visual.image_size
    preprocess = open_clip.image_transform(
        size[0] if isinstance(size, (tuple, list)) else size,
        is_train=False,
        mean=open_clip.OPENAI_DATASET_MEAN,
        std=open_clip.OPENAI_DATASET_STD,
    )
    reference = open_clip.get_model_config(name) or {}
    want = reference.get("embed_dim")
    got = int(model.text_projection.shape[1])
    if want and got != want:
        raise BackboneError(
            f"{path} holds a CLIP with {got}-dimensional embeddings, not {name}'s {want}: set clip.model to the "
            "architecture of that file"
        )
    return model, preprocess


def _hf_file_hint(name: str, pretrained: str) -> str:
    import open_clip

    hub = open_clip.get_pretrained_cfg(name, pretrained).get("hf_hub", "").rstrip("/")
    if not hub:
        return ""
    return (
        f" It is Hugging Face repository {hub}: `huggingface-cli download {hub} open_clip_model.safetensors` (or "
        f"open_clip_pytorch_model.bin) puts it in the standard cache ($HF_HOME/hub), which is searched first"
    )


def _load_open_clip(name: str, pretrained: str, cache_dir: Path, load_weights: bool = True):
    """(model, preprocess, tokenizer, activation) of an open_clip architecture with ``pretrained``
    weights (``load_weights=False``: the same model, untrained; tests decide activations so)."""
    import open_clip

    if name not in open_clip.list_models():
        raise BackboneError(
            f"run config 'clip.model' = {name!r} is not an open_clip architecture nor 'embedded-tiny'; "
            f"examples: ViT-B-16, ViT-B-32, RN50, ViT-L-14 (`open_clip.list_models()` lists all)"
        )
    tokenizer = open_clip.get_tokenizer(name)
    if not pretrained:
        log.warning("clip.pretrained is empty: %s is RANDOMLY INITIALISED (benchmarks only)", name)
        act = activation_of(name, "", None)
        model, _, preprocess = _random_init(name, act == QUICK_GELU)
        return model, preprocess, tokenizer, act
    path = weights_path(pretrained)
    if path is not None:
        return _from_file(name, pretrained, path, tokenizer)
    return _from_tag(name, pretrained, cache_dir, load_weights, tokenizer)


def _from_file(name: str, pretrained: str, path: Path, tokenizer):
    """``_load_open_clip`` of weights in a local file (an open_clip checkpoint or OpenAI's TorchScript)."""
    import open_clip

    if not path.is_absolute():
        raise BackboneError(
            f"run config 'clip.pretrained' = {pretrained!r} is a relative path: Flower runs the apps in whatever "
            "directory its processes started in; give an absolute path"
        )
    if not path.is_file():
        raise BackboneError(
            f"run config 'clip.pretrained' = {pretrained!r} looks like a file path but no such "
            "file exists on this machine"
        )
    try:
        if is_torchscript(path):
            model, preprocess = _load_torchscript(name, path)
            return model, preprocess, tokenizer, QUICK_GELU
        act = activation_of(name, pretrained, path)
        model, _, preprocess = open_clip.create_model_and_transforms(
            name, pretrained=str(path), force_quick_gelu=act == QUICK_GELU
        )
    except BackboneError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file fails in zip, pickle or state-dict code
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise BackboneError(
            f"run config 'clip.pretrained' = {pretrained!r} cannot be loaded as {name} weights "
            f"({type(err).__name__}: {first}): check that the file is complete (its size and checksum against "
            f"the source) and that clip.model names its architecture"
        ) from err
    return model, preprocess, tokenizer, act


def _from_tag(name: str, pretrained: str, cache_dir: Path, load_weights: bool, tokenizer):
    """``_load_open_clip`` of an open_clip pretrained tag: from the Hugging Face cache, ours, or
    OpenAI's legacy file."""
    import open_clip

    tags = open_clip.list_pretrained_tags_by_model(name)
    if pretrained not in tags:
        raise BackboneError(
            f"run config 'clip.pretrained' = {pretrained!r} is neither a pretrained tag of {name} "
            f"({', '.join(tags) or 'none'}) nor an existing checkpoint file"
        )
    act = activation_of(name, pretrained, None)
    quick = act == QUICK_GELU and not name.endswith("-quickgelu")
    if not load_weights:  # the architecture the weights would be loaded into (open_clip would download them)
        model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None, force_quick_gelu=quick)
        return model, preprocess, tokenizer, act
    online = _hub_reachable()
    errors = []
    # the standard Hugging Face cache first (what `huggingface-cli download` fills), then ours
    for where in (None, str(cache_dir / "open_clip") if cache_dir else None):
        try:
            with contextlib.nullcontext() if online else _hf_offline():
                model, _, preprocess = open_clip.create_model_and_transforms(
                    name, pretrained=pretrained, force_quick_gelu=quick, cache_dir=where
                )
            return model, preprocess, tokenizer, act
        except Exception as err:  # noqa: BLE001 - open_clip and huggingface_hub raise many kinds
            errors.append(f"{where or 'the Hugging Face cache'}: {err}")
    legacy = _openai_clip_file(name, pretrained)
    if legacy is not None:
        model, preprocess = _load_torchscript(name, legacy)
        return model, preprocess, tokenizer, QUICK_GELU
    where = "the download failed" if online else "this machine cannot reach huggingface.co and they are not cached"
    raise BackboneError(
        f"weights for {name} / {pretrained} could not be loaded: {where} ({'; '.join(errors)})."
        f"{_hf_file_hint(name, pretrained)}. Or supply them as a local file and set "
        "clip.pretrained='/absolute/path/to/it'"
    )


def _openai_clip_file(name: str, pretrained: str) -> Path | None:
    """OpenAI's own TorchScript file for an `openai` tag, where the `clip` package left it
    (~/.cache/clip/<arch>.pt), checked against the sha256 in OpenAI's URL."""
    import open_clip

    url = open_clip.get_pretrained_cfg(name, pretrained).get("url", "")
    if pretrained != "openai" or not url:
        return None
    path = OPENAI_CLIP_CACHE.expanduser() / url.rsplit("/", 1)[-1]
    if not path.is_file():
        return None
    expected = url.rsplit("/", 2)[-2]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected:
        log.warning("%s is not OpenAI's file (sha256 %s, expected %s): not used", path, digest[:12], expected[:12])
        return None
    return path


_CACHE: dict[tuple, ClipBundle] = {}


def load_clip(name: str, pretrained: str, cache_dir: Path, device: str = "auto") -> ClipBundle:
    """The frozen backbone; loaded once per process (simulated clients share a process)."""
    dev = resolve_device(device)
    key = (name, pretrained, str(cache_dir), str(dev))
    if key in _CACHE:
        return _CACHE[key]
    if name == tiny_clip.EMBEDDED_MODEL_NAME:
        model, path = tiny_clip.load_embedded_clip(Path(cache_dir))
        preprocess, augment, tok, act = _tiny_preprocess, _tiny_augment, tiny_clip.tokenizer(), GELU
        pretrained = "embedded (pretrained on the embedded domain at first use)"
    else:
        model, preprocess, tok, act = _load_open_clip(name, pretrained, Path(cache_dir))
        augment = _open_clip_augment(model, preprocess)
    fp = weights_fingerprint(name, model, act)
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
