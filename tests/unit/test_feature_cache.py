"""Image features are computed once, then served from memory and from disk."""

from __future__ import annotations

import numpy as np
import torch

from fedvlm.data.registry import load_dataset
from fedvlm.models import feature_cache


def test_features_computed_once_then_reused(pretrained_clip, tmp_path, monkeypatch):
    data = load_dataset("embedded")
    idx = np.arange(0, 40)
    calls = []
    real = feature_cache.encode_images

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(feature_cache, "encode_images", counting)
    f1 = feature_cache.image_features(pretrained_clip, data.train, idx, tmp_path)
    f2 = feature_cache.image_features(pretrained_clip, data.train, idx, tmp_path)
    assert len(calls) == 1 and f1 is f2
    assert f1.shape == (40, pretrained_clip.embed_dim)
    torch.testing.assert_close(f1.norm(dim=-1), torch.ones(40))
    # a fresh process (empty memory) reads the disk copy instead of encoding again
    feature_cache.clear_memory_cache()
    f3 = feature_cache.image_features(pretrained_clip, data.train, idx, tmp_path)
    assert len(calls) == 1 and torch.equal(f1, f3)
    assert len(list((tmp_path / "features").glob("*.pt"))) == 1
    # other images, other key
    feature_cache.image_features(pretrained_clip, data.train, idx + 1, tmp_path)
    assert len(calls) == 2


def test_cached_features_equal_direct_encoding(pretrained_clip, tmp_path):
    data = load_dataset("embedded")
    idx = np.array([3, 1, 4, 1, 5])
    cached = feature_cache.image_features(pretrained_clip, data.test, idx, tmp_path)
    with torch.no_grad():
        x = torch.stack([pretrained_clip.preprocess(data.test.image(i)) for i in idx])
        direct = torch.nn.functional.normalize(pretrained_clip.model.encode_image(x), dim=-1)
    torch.testing.assert_close(cached, direct)
