"""The embedded source model of Reprogrammable-FL: a small ResNet pretrained here, offline.

Reprogramming needs a *pretrained* source classifier: a random network gives the input
program nothing to steer. Where torchvision's ImageNet weights cannot be downloaded, this
stand-in plays ImageNet's role: a ResNet (BasicBlocks, BatchNorm, global pooling, an ``fc``
head like torchvision's) trained in-process on the embedded shapes domain's clean and
cluttered renderings under neutral light (40 source classes), cached by a hash of its recipe.
The default target task is scikit-learn's handwritten digits, a different domain and label
space: reprogramming a shapes classifier to read digits is the embedded analogue of
reprogramming an ImageNet model for CIFAR-10 (a much smaller one: 64 feature channels).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedvlm.data import embedded
from fedvlm.utils.files import atomic_torch_save, file_lock

log = logging.getLogger(__name__)

NAME = "embedded-tiny-resnet"
INPUT_SIZE = embedded.IMAGE_SIZE  # 32
MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)


@dataclass(frozen=True)
class ResNetRecipe:
    """Everything that determines the pretrained weights; its hash names the cache file."""

    seed: int = 0
    widths: tuple[int, ...] = (16, 32, 64)
    images_per_class: int = 150
    steps: int = 400
    batch_size: int = 128
    lr: float = 3e-3
    version: int = 2

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "domain": embedded.domain_version()}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), num_classes: int = len(embedded.CLASSNAMES)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _normalise(images: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(np.array(images, copy=True)).permute(0, 3, 1, 2).float().div_(255.0)
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def pretrain(recipe: ResNetRecipe = ResNetRecipe()) -> TinyResNet:
    t0 = time.time()
    torch.manual_seed(recipe.seed)
    model = TinyResNet(recipe.widths)
    # Clean and cluttered scenes under neutral light, as the embedded CLIP saw: features for
    # objects on busy backgrounds, not just for a plain grey field.
    half = recipe.images_per_class // 2
    parts = [
        embedded.generate(half, seed=30_000 + recipe.seed, style="pretrain"),
        embedded.generate(recipe.images_per_class - half, seed=31_000 + recipe.seed, style="pretrain-cluttered"),
    ]
    images = np.concatenate([p[0] for p in parts])
    x, y = _normalise(images), torch.from_numpy(np.concatenate([p[1] for p in parts]))
    rng = np.random.default_rng(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=recipe.steps, pct_start=0.1)
    model.train()
    for step in range(recipe.steps):
        idx = torch.from_numpy(rng.choice(len(x), size=recipe.batch_size, replace=False))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 100 == 0:
            log.info("tiny ResNet pretraining: step %d/%d, loss %.3f", step + 1, recipe.steps, loss.item())
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    log.info("tiny ResNet pretrained in %.1fs (source-task train accuracy %.1f%%)", time.time() - t0, 100 * acc)
    return model


def load_pretrained(cache_dir: Path, recipe: ResNetRecipe = ResNetRecipe()) -> tuple[TinyResNet, str]:
    """The pretrained embedded source model (eval mode), training it once on first use; a
    file lock makes concurrent first uses (server and clients) train it once."""
    path = Path(cache_dir) / "models" / f"{NAME}-{recipe.key()}.pt"
    if not path.exists():
        with file_lock(path):
            if not path.exists():
                log.info("pretraining the embedded tiny ResNet once (cached at %s)", path)
                atomic_torch_save({"recipe": asdict(recipe), "state_dict": pretrain(recipe).state_dict()}, path)
    model = TinyResNet(recipe.widths)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
    return model.eval(), f"{NAME}-{recipe.key()}"
