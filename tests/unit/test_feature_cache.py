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


# ---- the cache never serves features of images that are no longer there ----------------------


def _served_equals_fresh(bundle, source, cache_dir) -> bool:
    """Every feature the cache serves for ``source`` is the feature of the image there now."""
    idx = np.arange(len(source))
    served = feature_cache.image_features(bundle, source, idx, cache_dir)
    fresh = feature_cache.encode_images(bundle, source, idx, 64)
    return torch.allclose(served, fresh, atol=1e-6)


def test_moving_a_photo_between_class_folders_is_a_new_key(pretrained_clip, tmp_path):
    from fedvlm.data.registry import load_image_folder
    from tests.formats import make_image_folder

    root = tmp_path / "org"
    make_image_folder(root / "train")
    make_image_folder(root / "test", per_class=1)
    first = load_image_folder(root, 0.3).train
    assert _served_equals_fresh(pretrained_clip, first, tmp_path / "cache")
    # the audit: one mislabelled photo moved from 'cat' to 'dog' shifted which image each cached row was
    (root / "train" / "cat" / "cat_0.png").rename(root / "train" / "dog" / "cat_0.png")
    moved = load_image_folder(root, 0.3).train
    assert moved.content_key != first.content_key
    assert _served_equals_fresh(pretrained_clip, moved, tmp_path / "cache")


def test_replacing_files_under_the_same_names_and_another_root_are_new_keys(pretrained_clip, tmp_path):
    from fedvlm.data.registry import load_dataset as load
    from tests.formats import make_dtd, write_image

    cache = tmp_path / "cache"
    root = make_dtd(tmp_path / "a")
    first = load("dtd", data_root=str(root)).test
    assert _served_equals_fresh(pretrained_clip, first, cache)
    # the same names, other pixels (a re-download, a corrected file): the audit found 4 of 10 stale
    for path in sorted((root / "dtd" / "dtd" / "images").rglob("*.jpg"))[::2]:
        write_image(path, 2, "val")
    replaced = load("dtd", data_root=str(root)).test
    assert replaced.content_key != first.content_key
    assert _served_equals_fresh(pretrained_clip, replaced, cache)
    # another data-root holding a DTD shares no entry with this one
    other = load("dtd", data_root=str(make_dtd(tmp_path / "b"))).test
    assert other.identity == first.identity and other.content_key != replaced.content_key
    assert _served_equals_fresh(pretrained_clip, other, cache)


def test_a_dtd_tree_loads_every_label_and_split_right(tmp_path):
    from tests.formats import decode, make_dtd

    data = load_dataset("dtd", data_root=str(make_dtd(tmp_path)))
    assert data.classnames == ["banded", "blotchy", "braided"]
    for source, split in ((data.train, "train"), (data.test, "test")):
        assert len(source) == 6
        assert [decode(source.image(i)) for i in range(len(source))] == [(int(y), split) for y in source.labels]


def test_a_damaged_cache_file_is_encoded_again_with_a_warning(pretrained_clip, tmp_path, caplog):
    data = load_dataset("embedded")
    idx = np.arange(0, 8)
    first = feature_cache.image_features(pretrained_clip, data.train, idx, tmp_path)
    (cached,) = (tmp_path / "features").glob("*.pt")
    cached.write_bytes(cached.read_bytes()[:100])  # a disk that filled up mid-write, a bad copy
    feature_cache.clear_memory_cache()
    again = feature_cache.image_features(pretrained_clip, data.train, idx, tmp_path)
    assert torch.equal(first, again)
    assert str(cached) in caplog.text and "it is encoded again" in caplog.text
    feature_cache.clear_memory_cache()  # the rewritten file reads back
    assert torch.equal(feature_cache.image_features(pretrained_clip, data.train, idx, tmp_path), first)
