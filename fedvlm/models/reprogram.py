"""Reprogrammable-FL's models: a frozen source classifier, the input program and output map of
model reprogramming, and the three fine-tuning baselines (docs/methods.md "Reprogrammable-FL").

Model reprogramming (``reprogram``): a target image, resized to ``s`` (``reprogram.image-size``),
is zero-padded to the source model's input size S and perturbed by a trainable program,

    x' = ZeroPad(x) + tanh(M ⊙ Θ),   M = 1 on the padded border, 0 over the image,

then goes through the frozen source model f_S; a trainable linear map W turns its source logits
into the K target classes. Only Θ (3 x S x S, of which the border is used) and W train.

Baselines, all under the same DP-SGD and FedAvg:
- ``bl-ff``: the whole pretrained network fine-tuned, with a new K-way head. BatchNorm mixes the
  samples of a batch, which per-sample clipping cannot allow, so every BatchNorm is replaced by
  a GroupNorm (Opacus' ``ModuleValidator.fix``; its affine parameters restart).
- ``bl-pf``: only the new head trains on the frozen pretrained features.
- ``bl-ts``: the same architecture from random weights (GroupNorm), every parameter trains.

The frozen source network always stays in eval mode, so its BatchNorm layers use their running
statistics and never mix samples; reprogramming and partial fine-tuning need no replacement.

Source models: torchvision's ResNet-18/50/152 and ResNeXt-50/101 with ImageNet weights
(downloaded by torchvision into its cache, or a local state-dict file), and the embedded ResNets
pretrained here (``models.embedded_resnet``) for offline runs. ``random`` weights exist for
tests and are labelled as such everywhere.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedvlm.models import embedded_resnet
from fedvlm.models.clip_loader import _hub_reachable
from fedvlm.runconfig import RunConfig
from fedvlm.utils.files import UnreadableFile, load_saved

log = logging.getLogger(__name__)

# torchvision builder name -> the name of its ImageNet weights enum
TORCHVISION_SOURCES = {
    "resnet18": "ResNet18_Weights",
    "resnet50": "ResNet50_Weights",
    "resnet152": "ResNet152_Weights",
    "resnext50_32x4d": "ResNeXt50_32X4D_Weights",
    "resnext101_32x8d": "ResNeXt101_32X8D_Weights",
}
SOURCE_MODELS = (*embedded_resnet.SOURCES, *TORCHVISION_SOURCES)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MODEL_KINDS = ("mr", "ff", "pf", "ts")  # reprogramming, full / partial fine-tune, from scratch


class SourceModelError(RuntimeError):
    """A source model that cannot be loaded; the message says how to fix it."""


@dataclass
class SourceModel:
    name: str
    model: nn.Module  # frozen, eval mode; its classifier is ``model.fc``
    input_size: int  # S
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    weights: str  # what the weights are, in words ("imagenet (IMAGENET1K_V2)", "random init (NOT pretrained)", ...)
    fingerprint: str

    @property
    def num_source_classes(self) -> int:
        fc = self.model.fc
        assert isinstance(fc, nn.Linear)  # every source model (ResNets, EmbeddedResNet) ends in one
        return fc.out_features


def _torchvision_source(name: str, weights: str) -> tuple[nn.Module, str, str]:
    import torchvision

    builder = getattr(torchvision.models, name)
    if weights == "random":
        return builder(weights=None), "random init (NOT pretrained)", f"{name}:random"
    if weights in ("imagenet", "auto"):
        enum = getattr(torchvision.models, TORCHVISION_SOURCES[name]).DEFAULT
        cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(enum.url).name
        if not cached.exists() and not _hub_reachable("download.pytorch.org"):
            raise SourceModelError(
                f"ImageNet weights of {name} are not in torchvision's cache ({cached}) and "
                f"download.pytorch.org cannot be reached: download {enum.url} to that path on a machine "
                f"with network, or set reprogram.source-weights to a local state-dict file"
            )
        try:
            return builder(weights=enum), f"imagenet ({enum.name})", f"{name}:{enum.name}"
        except Exception as e:  # network or file errors: say what to do
            raise SourceModelError(
                f"loading ImageNet weights of {name} failed ({e}); download {enum.url} "
                f"into {cached.parent} or set reprogram.source-weights to a local file"
            ) from e
    path = Path(weights).expanduser()
    if not path.is_file():
        raise SourceModelError(
            f"reprogram.source-weights = {weights!r} is neither 'imagenet', 'random' nor an existing state-dict file"
        )
    model = builder(weights=None)
    try:
        state = load_saved(path, f"reprogram.source-weights must be a complete state-dict file of {name}")
    except UnreadableFile as err:
        raise SourceModelError(str(err)) from err
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise SourceModelError(f"{path} does not hold {name} weights: {str(e).splitlines()[0]}") from e
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return model, f"file {path}", f"{name}:file-{digest}"


def load_source(name: str, weights: str, cache_dir: Path) -> SourceModel:
    """The frozen source classifier (see the module docstring for ``weights``)."""
    model: nn.Module
    if name in embedded_resnet.SOURCES:
        if weights == "random":
            model, label, fp = embedded_resnet.architecture(name), "random init (NOT pretrained)", f"{name}:random"
        elif weights in ("auto", "embedded"):
            model, fp, _ = embedded_resnet.load_pretrained(name, cache_dir)
            domain = embedded_resnet.DOMAINS[embedded_resnet.SOURCES[name].domain]
            label = f"pretrained here on {domain.description} (not ImageNet)"
        else:
            raise SourceModelError(
                f"reprogram.source-weights = {weights!r} does not apply to {name}: use 'auto' "
                "(pretrained here) or 'random'"
            )
        size, mean, std = embedded_resnet.INPUT_SIZE, embedded_resnet.MEAN, embedded_resnet.STD
    elif name in TORCHVISION_SOURCES:
        model, label, fp = _torchvision_source(name, weights)
        size, mean, std = 224, IMAGENET_MEAN, IMAGENET_STD
    else:
        raise SourceModelError(f"unknown source model {name!r}; accepted: {', '.join(SOURCE_MODELS)}")
    model.eval().requires_grad_(False)
    return SourceModel(name, model, size, mean, std, label, fp)


_SOURCES: dict[tuple, SourceModel] = {}


def cached_source(name: str, weights: str, cache_dir: Path) -> SourceModel:
    """``load_source`` once per process (a Ray worker or a ServerApp serves many messages)."""
    key = (name, weights, str(cache_dir))
    if key not in _SOURCES:
        _SOURCES[key] = load_source(name, weights, Path(cache_dir))
    return _SOURCES[key]


class InputProgram(nn.Module):
    """x' = ZeroPad(x) + tanh(M ⊙ Θ): the trainable part of the input transform."""

    def __init__(self, source_size: int, image_size: int):
        super().__init__()
        if not 0 < image_size <= source_size:
            raise ValueError(f"reprogram.image-size = {image_size} must be in 1..{source_size} (the source input size)")
        self.source_size, self.image_size = source_size, image_size
        self.theta = nn.Parameter(torch.zeros(3, source_size, source_size))
        lo = (source_size - image_size) // 2
        mask = torch.ones(1, source_size, source_size)
        mask[:, lo : lo + image_size, lo : lo + image_size] = 0.0
        # A plain attribute, not a buffer: Opacus computes per-sample gradients of modules with
        # parameters only (it refuses trainable modules that hold buffers).
        self._mask = mask
        self.pad = (lo, source_size - image_size - lo, lo, source_size - image_size - lo)

    def mask(self) -> torch.Tensor:
        if self._mask.device != self.theta.device:
            self._mask = self._mask.to(self.theta.device)
        return self._mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, self.pad) + torch.tanh(self.mask() * self.theta)


class Normalise(nn.Module):
    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class FrozenEval(nn.Module):
    """Wraps a frozen network so that ``.train()`` on the parent never switches it out of eval
    mode (its BatchNorm must keep using running statistics)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net.eval().requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        self.net.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ReprogramNet(nn.Module):
    def __init__(self, source: SourceModel, image_size: int, num_classes: int):
        super().__init__()
        self.program = InputProgram(source.input_size, image_size)
        self.normalise = Normalise(source.mean, source.std)
        self.source = FrozenEval(source.model)
        self.output_map = nn.Linear(source.num_source_classes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_map(self.source(self.normalise(self.program(x))))


class FineTuneNet(nn.Module):
    """The baselines: the source network (or its architecture) with a new K-way head."""

    def __init__(self, source: SourceModel, num_classes: int, kind: str):
        super().__init__()
        from opacus.validators import ModuleValidator

        self.normalise = Normalise(source.mean, source.std)
        net = copy.deepcopy(source.model)
        if kind == "ts":  # same architecture, fresh weights
            for m in net.modules():
                reset = getattr(m, "reset_parameters", None)
                if reset is not None:
                    reset()
        fc = net.fc
        assert isinstance(fc, nn.Linear)  # see SourceModel.num_source_classes
        head = nn.Linear(fc.in_features, num_classes)
        net.fc = head
        self.head: nn.Module | None
        if kind == "pf":
            net.fc = nn.Identity()
            self.body = FrozenEval(net)
            self.head = head
        else:
            # torchvision's residual blocks add in place, which Opacus' backward hooks cannot
            # follow: per-sample gradients of the whole network come from ExpandedWeights
            self.per_sample_backend = "expanded"
            net.requires_grad_(True)  # before fix(): the validator only replaces trainable BatchNorm
            # one INFO line per replaced layer, per message and per BatchNorm fixed otherwise
            logging.getLogger("opacus.validators").setLevel(logging.WARNING)
            net = ModuleValidator.fix(net)  # BatchNorm -> GroupNorm: per-sample gradients need it
            for m in net.modules():  # Opacus' hooks cannot follow torchvision's in-place ReLUs
                if isinstance(m, nn.ReLU):
                    m.inplace = False
            self.body = net
            self.head = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(self.normalise(x))
        return self.head(out) if self.head is not None else out


def build_model(kind: str, source: SourceModel, num_classes: int, image_size: int, seed: int) -> nn.Module:
    """The client model of one of ``MODEL_KINDS`` with seeded initial values of its trainable
    parameters."""
    torch.manual_seed(seed)
    model = ReprogramNet(source, image_size, num_classes) if kind == "mr" else FineTuneNet(source, num_classes, kind)
    return model


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that train, hence the ones a client shares (FedAvg)."""
    return {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}


def input_size(kind: str, source: SourceModel, image_size: int) -> int:
    """The size target images are resized to: s for reprogramming (then padded), S for the
    baselines (the paper upsamples to the source model's input size)."""
    return image_size if kind == "mr" else source.input_size


def source_model(cfg: RunConfig) -> SourceModel:
    """The run config's source model (cached per process)."""
    return cached_source(cfg.reprogram.source_model, cfg.reprogram.source_weights, cfg.cache_path)


def initial_model(cfg: RunConfig, kind: str, num_classes: int) -> nn.Module:
    """The run's model of ``kind`` (its method's ``MethodSpec.model_kind``), with the run's seeded
    initial values: the server sends these to every client in round 1, so every process builds
    the same ones."""
    return build_model(kind, source_model(cfg), num_classes, cfg.reprogram.image_size, cfg.seed)
