"""The embedded "motifs" domain: Reprogrammable-FL's offline source domain and target task.

Reprogramming's claim (a frozen pretrained classifier, steered by an input program and read by
a linear map of its logits, beats a new head on its features under the same DP-SGD budget)
rests on what ImageNet gives a source network: many fine-grained classes, whose logits carry
features a coarse target task can be read from, and a network too large for full fine-tuning
under DP-SGD noise. This domain gives the embedded source the same two things, offline:

- source (``split="source"``): 240 classes, every (fill, colour, shape) of 3 fills (solid,
  striped, dotted) x 8 colours x 10 shapes, named ``"striped red star"``; 32 px, neutral
  light, textured backgrounds, objects of varied size and position. The embedded motif ResNet
  (``models.embedded_resnet``) is pretrained on it, as a torchvision ResNet is on ImageNet.
- target (``split="target"``, the ``motifs`` dataset): the 10 shapes alone, colour and fill
  drawn at random as nuisance, photographed by someone else: under a cool illuminant,
  rendered at 32 px and averaged down to 16 px. CIFAR-10 stands to ImageNet the same way:
  coarse classes over the source's concepts, in small photographs taken elsewhere.

Both were fixed before any Reprogrammable-FL comparison was run on them (issue 16), so the
task is not tuned to the methods' ordering. Generation is seeded numpy, offline.
"""

from __future__ import annotations

import hashlib

import numpy as np

from fedvlm.data.embedded import COLORS, IMAGE_SIZE, RenderStyle, _background, _shape_mask

SHAPES: tuple[str, ...] = (
    "circle",
    "ring",
    "square",
    "frame",
    "triangle",
    "diamond",
    "cross",
    "star",
    "bar",
    "crescent",
)
FILLS: tuple[str, ...] = ("solid", "striped", "dotted")
SOURCE_CLASSES: tuple[str, ...] = tuple(f"{f} {c} {s}" for f in FILLS for c in COLORS for s in SHAPES)
TARGET_CLASSES = SHAPES
TARGET_SIZE = 16  # the target's low resolution
VERSION = 1  # bump when the rendering code changes: caches keyed by domain_version() follow

SOURCE_STYLE = RenderStyle((6.0, 12.0), 7.0, 0.05, 0.45, 0.03)
TARGET_STYLE = RenderStyle((7.0, 12.0), 5.0, 0.08, 0.5, 0.04, tint=(0.7, 0.95, 1.35))
DARK = 0.35  # stripes and dots: the paint at this brightness
PERIOD = (3.5, 4.5)  # stripe and dot spacing, pixels

_YY, _XX = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) + 0.5


def _fill_pattern(fill: str, rng: np.random.Generator) -> np.ndarray:
    """Where the paint is dark (stripes or dots), over the whole frame."""
    if fill == "solid":
        return np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
    period, angle = rng.uniform(*PERIOD), rng.uniform(0, np.pi)
    if fill == "striped":
        phase = rng.uniform(0, 2 * np.pi)
        return np.sin(2 * np.pi * (np.cos(angle) * _XX + np.sin(angle) * _YY) / period + phase) > 0
    ox, oy = rng.uniform(0, period, 2)  # dotted: a grid of dots of radius ~period / 3.5
    dx = (_XX - ox) % period - period / 2
    dy = (_YY - oy) % period - period / 2
    return dx * dx + dy * dy <= (period / 3.5) ** 2


def render(fill: str, color: str, shape: str, rng: np.random.Generator, style: RenderStyle) -> np.ndarray:
    """One 32x32 float image in [0, 1] of the motif under ``style``."""
    img = _background(rng, style)
    r = rng.uniform(*style.size_range)
    jitter = min(style.center_jitter, max(IMAGE_SIZE / 2 - r, 0.0))
    cx, cy = IMAGE_SIZE / 2 + rng.uniform(-jitter, jitter, 2)
    mask = _shape_mask(shape, cx, cy, r, rng.uniform(-0.35, 0.35))  # small tilts: a square stays one
    paint = np.clip(np.array(COLORS[color]) + rng.normal(0, style.color_jitter, 3), 0, 1) * rng.uniform(0.8, 1.1)
    dark = _fill_pattern(fill, rng)
    img[mask & ~dark] = np.clip(paint, 0, 1)
    img[mask & dark] = np.clip(DARK * paint, 0, 1)
    img *= np.asarray(style.tint, dtype=np.float32)
    img += rng.normal(0, style.pixel_noise, img.shape).astype(np.float32)
    return np.clip(img, 0, 1)


def _downsample(img: np.ndarray, size: int) -> np.ndarray:
    k = IMAGE_SIZE // size
    return img.reshape(size, k, size, k, 3).mean(axis=(1, 3))


def generate(n_per_class: int, seed: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``n_per_class`` images of every class of ``split`` ("source": 240 classes at 32 px;
    "target": 10 shapes at 16 px): (uint8 [N, H, W, 3], int64 labels)."""
    if split not in ("source", "target"):
        raise ValueError(f"motifs split {split!r}: use 'source' or 'target'")
    rng = np.random.default_rng(seed)
    n_classes = len(SOURCE_CLASSES if split == "source" else TARGET_CLASSES)
    labels = np.repeat(np.arange(n_classes), n_per_class)
    rng.shuffle(labels)
    size = IMAGE_SIZE if split == "source" else TARGET_SIZE
    images = np.empty((len(labels), size, size, 3), dtype=np.uint8)
    for i, y in enumerate(labels):
        if split == "source":
            fill, color, shape = SOURCE_CLASSES[y].split(" ")
            img = render(fill, color, shape, rng, SOURCE_STYLE)
        else:  # colour and fill are nuisance: drawn per image
            fill, color = FILLS[rng.integers(len(FILLS))], tuple(COLORS)[rng.integers(len(COLORS))]
            img = _downsample(render(fill, color, SHAPES[y], rng, TARGET_STYLE), size)
        images[i] = (img * 255).round().astype(np.uint8)
    return images, labels.astype(np.int64)


def domain_version() -> str:
    """A short hash of everything that shapes the images, for cache keys."""
    blob = repr(
        (VERSION, SOURCE_CLASSES, sorted(COLORS.items()), SOURCE_STYLE, TARGET_STYLE, TARGET_SIZE, DARK, PERIOD)
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:10]
