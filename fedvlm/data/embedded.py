"""The embedded "shapes" domain: a deterministic, offline image-classification dataset.

Every image shows one coloured geometric shape; the class is the pair (colour, shape),
named in words ("red circle") so that the names can feed CLIP prompts. 8 colours x 5 shapes
= 40 classes, enough for every one of 10 pathological clients to hold several.

Two renderings of the same world exist on purpose:
- ``style="pretrain"``: clean, centred, large objects on plain backgrounds. The embedded tiny
  CLIP is pretrained contrastively on these with captions, so it "knows the domain" the way a
  web-pretrained CLIP knows photos.
- ``style="task"``: the federated task's images: textured backgrounds, pixel noise, smaller
  objects anywhere in the frame and stronger colour jitter. The shift makes zero-shot
  transfer imperfect, which leaves prompt learning something real to learn.

Generation is pure numpy from a seeded generator, so the same seed gives the same bytes on
every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IMAGE_SIZE = 32

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.86, 0.12, 0.10),
    "orange": (0.96, 0.52, 0.08),
    "yellow": (0.94, 0.88, 0.16),
    "green": (0.16, 0.68, 0.20),
    "cyan": (0.14, 0.80, 0.84),
    "blue": (0.12, 0.22, 0.88),
    "purple": (0.52, 0.18, 0.74),
    "pink": (0.96, 0.50, 0.74),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "ring")

CLASSNAMES: tuple[str, ...] = tuple(f"{c} {s}" for c in COLORS for s in SHAPES)
# every shape ``_shape_mask`` draws (this domain's, ``data.scenes``' and ``data.motifs``')
MASK_SHAPES = (*SHAPES, "diamond", "frame", "star", "bar", "crescent")


@dataclass(frozen=True)
class RenderStyle:
    """How one rendering of the world looks."""

    size_range: tuple[float, float]  # object radius in pixels
    center_jitter: float  # max offset of the centre from the middle, in pixels
    color_jitter: float  # std of the per-channel colour perturbation
    texture: float  # contrast of the background texture (0 = a plain grey background)
    pixel_noise: float  # std of additive Gaussian pixel noise
    tint: tuple[float, float, float] = (1.0, 1.0, 1.0)  # illuminant: per-channel gain
    hue_shift: float = 0.0  # rotation of the objects' paint hue, in degrees


STYLES: dict[str, RenderStyle] = {
    "pretrain": RenderStyle((8.0, 12.0), 3.0, 0.04, 0.0, 0.02),
    # The pretraining corpus also holds cluttered scenes, under neutral light.
    "pretrain-cluttered": RenderStyle((7.0, 12.0), 6.0, 0.06, 0.5, 0.04),
    # The task: cluttered scenes under a warm illuminant that zero-shot prompts never saw.
    "task": RenderStyle((7.0, 12.0), 6.0, 0.06, 0.5, 0.04, tint=(1.3, 0.85, 0.45)),
}

_YY, _XX = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) + 0.5


def _shape_mask(shape: str, cx: float, cy: float, r: float, theta: float) -> np.ndarray:
    """Boolean mask of one shape (rotated by theta) centred at (cx, cy) with radius r."""
    dx, dy = _XX - cx, _YY - cy
    c, s = np.cos(theta), np.sin(theta)
    u, v = c * dx + s * dy, -s * dx + c * dy  # coordinates in the shape's frame
    dist = np.sqrt(dx * dx + dy * dy)
    if shape == "circle":
        return dist <= r
    if shape == "ring":
        return (dist <= r) & (dist >= 0.55 * r)
    if shape == "square":
        return (np.abs(u) <= 0.78 * r) & (np.abs(v) <= 0.78 * r)
    if shape == "diamond":  # a rhombus, twice as tall as wide: never a rotated square
        return np.abs(u) / 0.55 + np.abs(v) <= r
    if shape == "cross":
        arm = 0.32 * r
        return ((np.abs(u) <= arm) & (np.abs(v) <= r)) | ((np.abs(v) <= arm) & (np.abs(u) <= r))
    if shape == "triangle":
        inside = np.ones_like(u, dtype=bool)
        for k in range(3):  # intersection of three half-planes at 120 degrees
            a = 2 * np.pi * k / 3
            inside &= (np.cos(a) * u + np.sin(a) * v) <= 0.6 * r
        return inside
    # The motifs domain's further shapes (``data.motifs``)
    if shape == "frame":  # a square outline
        outer = (np.abs(u) <= 0.8 * r) & (np.abs(v) <= 0.8 * r)
        return outer & ~((np.abs(u) <= 0.45 * r) & (np.abs(v) <= 0.45 * r))
    if shape == "star":  # five points: the radius swings between 0.45 r and r
        return dist <= r * (0.45 + 0.55 * np.abs(np.cos(2.5 * np.arctan2(v, u))) ** 2)
    if shape == "bar":
        return (np.abs(u) <= r) & (np.abs(v) <= 0.3 * r)
    if shape == "crescent":  # a disc with an offset disc cut out
        return (dist <= r) & ((u - 0.45 * r) ** 2 + v * v > (0.8 * r) ** 2)
    raise ValueError(f"unknown shape {shape!r}; known: {MASK_SHAPES}")


def _rotate_hue(rgb: np.ndarray, degrees: float) -> np.ndarray:
    import colorsys

    h, lightness, s = colorsys.rgb_to_hls(*rgb)
    return np.array(colorsys.hls_to_rgb((h + degrees / 360.0) % 1.0, lightness, s))


def _background(rng: np.random.Generator, style: RenderStyle) -> np.ndarray:
    gray = rng.uniform(0.25, 0.55)
    img = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), gray, dtype=np.float32)
    if style.texture == 0:
        return img
    # Texture: a smooth random colour field (bilinear upsampling of a 4x4 grid) plus stripes,
    # so that the background carries colours that are not the object's.
    grid = rng.uniform(-0.2, 0.2, size=(4, 4, 3)).astype(np.float32)
    idx = np.linspace(0, 3, IMAGE_SIZE, dtype=np.float32)
    i0 = np.clip(idx.astype(int), 0, 2)
    w = (idx - i0)[:, None]
    rows = grid[i0] * (1 - w[..., None]) + grid[i0 + 1] * w[..., None]  # (32, 4, 3)
    field = rows[:, i0] * (1 - w.T[..., None]) + rows[:, i0 + 1] * w.T[..., None]
    freq, phase = rng.uniform(0.2, 0.8), rng.uniform(0, 2 * np.pi)
    angle = rng.uniform(0, np.pi)
    stripes = 0.1 * np.sin(freq * (np.cos(angle) * _XX + np.sin(angle) * _YY) + phase)
    return img + style.texture * (field + stripes[..., None]).astype(np.float32)


def render(label: int, rng: np.random.Generator, style: str = "task") -> tuple[np.ndarray, dict]:
    """Render one image of class ``label``; returns (uint8 HxWx3 image, attributes)."""
    st = STYLES[style]
    color_name, shape = CLASSNAMES[label].split(" ")
    img = _background(rng, st)
    r = rng.uniform(*st.size_range)
    margin = IMAGE_SIZE / 2 - r
    jitter = min(st.center_jitter, max(margin, 0.0))
    cx = IMAGE_SIZE / 2 + rng.uniform(-jitter, jitter)
    cy = IMAGE_SIZE / 2 + rng.uniform(-jitter, jitter)
    # Small tilts only: a square turned by 45 degrees would look like a diamond.
    theta = rng.uniform(-0.35, 0.35)
    mask = _shape_mask(shape, cx, cy, r, theta)
    color = np.array(COLORS[color_name])
    if st.hue_shift:
        color = _rotate_hue(color, st.hue_shift)
    color = np.clip(color + rng.normal(0, st.color_jitter, 3), 0, 1)
    shade = rng.uniform(0.8, 1.1)  # lighting
    img[mask] = np.clip(color * shade, 0, 1)
    img *= np.asarray(st.tint, dtype=np.float32)
    img += rng.normal(0, st.pixel_noise, img.shape).astype(np.float32)
    img = (np.clip(img, 0, 1) * 255).round().astype(np.uint8)
    attrs = {
        "color": color_name,
        "shape": shape,
        "size": "small" if r < 7.5 else "large",
        "x": "left" if cx < 13 else ("right" if cx > 19 else "center"),
    }
    return img, attrs


def domain_version() -> str:
    """A short hash of everything that shapes the generated images and captions, so
    caches keyed by it are invalidated whenever the domain changes."""
    import hashlib

    blob = repr(
        (sorted(STYLES.items()), CLASSNAMES, sorted(COLORS.items()), IMAGE_SIZE, _TEMPLATES, _PREFIXES, _SUFFIXES)
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def generate(n_per_class: int, seed: int, style: str = "task") -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """Generate ``n_per_class`` images per class: (uint8 [N,32,32,3], int64 labels, attrs)."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(CLASSNAMES)), n_per_class)
    rng.shuffle(labels)
    images = np.empty((len(labels), IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    attrs = []
    for i, y in enumerate(labels):
        images[i], a = render(int(y), rng, style)
        attrs.append(a)
    return images, labels.astype(np.int64), attrs


# Web-like captions: many phrasings, the class name's own word order ("red circle") in only
# some of them, and never the zero-shot template "a photo of a ...". Hand-written prompts
# then fit the text tower imperfectly, as they do for a web-pretrained CLIP.
_TEMPLATES = (
    "a {c} {s}.",
    "a {s} that is {c}.",
    "a {size} {c} {s}.",
    "a {s} painted {c} on the {x}.",
    "the {s} here is {c}.",
    "a {c} coloured {s} on the {x}.",
    "one {s}, {c}.",
    "{c} {s}",
)
# Prefixes and suffixes vary the caption length, so that every text position a prompt with
# 16 context tokens uses (up to about 24) is trained, as web captions train a real CLIP's.
_PREFIXES = (
    "",
    "",
    "this image shows",
    "in this picture we can see",
    "here is",
    "look at this",
    "a simple synthetic scene with nothing in it but",
)
_SUFFIXES = (
    "",
    "",
    "on a background",
    "in the frame of a small square image",
    "drawn with a single flat colour and no outline at all",
)


def caption(attrs: dict, rng: np.random.Generator) -> str:
    """A caption for a pretraining image: a template, with an optional prefix and suffix."""
    x = {"left": "left", "right": "right", "center": "middle"}[attrs["x"]]
    t = _TEMPLATES[rng.integers(len(_TEMPLATES))]
    core = t.format(c=attrs["color"], s=attrs["shape"], size=attrs["size"], x=x)
    pre = _PREFIXES[rng.integers(len(_PREFIXES))]
    suf = _SUFFIXES[rng.integers(len(_SUFFIXES))]
    return " ".join(p for p in (pre, core.rstrip("."), suf) if p) + "."
