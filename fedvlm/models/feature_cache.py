"""Frozen image features, computed once and reused across steps, rounds and runs.

CLIP's image tower is frozen in every prompt method, so an image's feature never changes:
it is computed once per (backbone weights, the exact images: ``ImageSource.content_key``,
transform, image set) and kept
- in memory, for the life of the process (a Ray worker serves many simulated clients and
  rounds; a deployed SuperNode starts a fresh process per message and relies on disk), and
- on disk under ``<cache-dir>/features/<key>.pt``, written atomically under a lock so that
  concurrent clients compute each entry once.

Augmentation changes the input every step and so bypasses this cache (opt-in, slow).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.data.sources import ImageSource
from fedvlm.utils.files import UnreadableFile, atomic_torch_save, file_lock, load_saved
from fedvlm.utils.progress import bar

log = logging.getLogger(__name__)

_MEMORY: dict[str, torch.Tensor] = {}


def cache_key(fingerprint: str, source: ImageSource, indices: np.ndarray, transform_id: str) -> str:
    h = hashlib.sha256()
    for part in (fingerprint, source.content_key, transform_id):
        h.update(part.encode())
        h.update(b"\0")
    h.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    return h.hexdigest()[:24]


@torch.no_grad()
def encode_images(
    bundle, source: ImageSource, indices: np.ndarray, batch_size: int, transform=None, kind: str = "pooled"
) -> torch.Tensor:
    """Normalised image features of ``source[indices]`` (float32, on CPU): pooled [n, D], or
    with ``kind="patch-tokens"`` one embedding per patch [n, P, D] (FedOTP)."""
    transform = transform or bundle.preprocess
    out = []
    with bar(len(indices), f"encoding {source.identity}", "image") as images:
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            pixels = torch.stack([transform(source.image(int(i))) for i in chunk]).to(bundle.device)
            if kind == "patch-tokens":
                from fedvlm.models.patch_tokens import encode_patch_tokens

                out.append(encode_patch_tokens(bundle.model, pixels).cpu())
            else:
                out.append(F.normalize(bundle.model.encode_image(pixels).float(), dim=-1).cpu())
            images.update(len(chunk))  # counted once encoded
    return torch.cat(out) if out else torch.empty(0, bundle.embed_dim)


def image_features(
    bundle,
    source: ImageSource,
    indices: np.ndarray,
    cache_dir: Path | None,
    batch_size: int = 128,
    kind: str = "pooled",
) -> torch.Tensor:
    """Cached ``encode_images`` (memory, then disk, then compute)."""
    indices = np.asarray(indices, dtype=np.int64)
    key = cache_key(bundle.fingerprint, source, indices, "eval" if kind == "pooled" else kind)
    if key in _MEMORY:
        return _MEMORY[key]
    feats = None
    path = Path(cache_dir) / "features" / f"{key}.pt" if cache_dir else None
    if path is not None:
        with file_lock(path):
            if path.exists():
                try:
                    feats = load_saved(path, "it is encoded again")
                except UnreadableFile as err:  # a cache: what it held is computed again from the images
                    log.warning("%s", err)
            if feats is None:
                t0 = time.time()
                feats = encode_images(bundle, source, indices, batch_size, kind=kind)
                atomic_torch_save(feats, path)
                log.info("encoded %d images of %s in %.1fs (cached)", len(indices), source.identity, time.time() - t0)
    else:
        feats = encode_images(bundle, source, indices, batch_size, kind=kind)
    _MEMORY[key] = feats
    return feats


def clear_memory_cache() -> None:
    _MEMORY.clear()
