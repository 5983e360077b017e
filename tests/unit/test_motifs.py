"""The motifs domain (Reprogrammable-FL's offline source and target) and the embedded source
ResNets pretrained on it: deterministic, what the classes say, cached once."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fedvlm.data import embedded, motifs
from fedvlm.data.registry import load_dataset
from fedvlm.models import embedded_resnet


def test_source_classes_are_every_fill_colour_and_shape():
    assert len(motifs.SOURCE_CLASSES) == 3 * 8 * 10 == len(set(motifs.SOURCE_CLASSES))
    assert motifs.SOURCE_CLASSES[0] == "solid red circle" and motifs.SOURCE_CLASSES[-1] == "dotted pink crescent"
    x, y = motifs.generate(2, seed=0, split="source")
    assert x.shape == (480, 32, 32, 3) and x.dtype == np.uint8 and np.bincount(y).tolist() == [2] * 240


def test_every_shape_is_drawn_and_no_two_coincide():
    masks = {s: embedded._shape_mask(s, 16.0, 16.0, 10.0, 0.0) for s in motifs.SHAPES}
    for s, m in masks.items():
        assert 30 < m.sum() < 32 * 32, s
    for a in motifs.SHAPES:
        for b in motifs.SHAPES:
            if a < b:
                assert (masks[a] ^ masks[b]).sum() > 20, (a, b)
    with pytest.raises(ValueError, match="known: .*crescent"):
        embedded._shape_mask("hexagon", 16.0, 16.0, 10.0, 0.0)


def test_fills_darken_part_of_the_object_only_for_stripes_and_dots():
    rng = np.random.default_rng(0)
    assert not motifs._fill_pattern("solid", rng).any()
    for fill in ("striped", "dotted"):
        share = motifs._fill_pattern(fill, rng).mean()
        assert 0.1 < share < 0.6, fill


def test_the_target_task_is_the_shapes_at_low_resolution_under_another_light():
    d = load_dataset("motifs")
    again = load_dataset("motifs")
    assert np.array_equal(d.train.images, again.train.images)  # deterministic
    assert d.classnames == list(motifs.SHAPES) and d.n_classes == 10
    assert len(d.train) == 2000 and len(d.test) == 600 and np.bincount(d.train.labels).min() == 200
    assert d.train.image(0).size == (16, 16)
    # the cool illuminant: the target is bluer than the source's neutral light
    src, _ = motifs.generate(4, seed=1, split="source")
    tgt = d.train.images.astype(float)
    assert tgt[..., 2].mean() - tgt[..., 0].mean() > src[..., 2].mean() - src[..., 0].mean() + 20


def test_the_domain_version_follows_the_rendering():
    v = motifs.domain_version()
    assert v == motifs.domain_version() and len(v) == 10
    original = motifs.TARGET_STYLE
    try:
        motifs.TARGET_STYLE = replace(original, pixel_noise=0.05)
        assert motifs.domain_version() != v
    finally:
        motifs.TARGET_STYLE = original


def test_a_source_is_pretrained_once_and_reloaded_with_its_report(tmp_path, monkeypatch):
    small = embedded_resnet.ResNetRecipe("motifs", (8, 16), images_per_class=2, steps=3, batch_size=32)
    monkeypatch.setitem(embedded_resnet.SOURCES, "embedded-motif-resnet", small)
    calls = []
    real = embedded_resnet.pretrain
    monkeypatch.setattr(embedded_resnet, "pretrain", lambda r: calls.append(r) or real(r))
    a, key, report = embedded_resnet.load_pretrained("embedded-motif-resnet", tmp_path)
    b, key2, report2 = embedded_resnet.load_pretrained("embedded-motif-resnet", tmp_path)
    assert calls == [small] and key == key2 == f"embedded-motif-resnet-{small.key()}"
    assert report == report2 and report["source_classes"] == 240 and report["train_images"] == 480
    assert report["parameters"] == sum(p.numel() for p in a.parameters())
    assert 0.0 <= report["heldout_accuracy"] <= 1.0 and report["seconds"] > 0
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not a.training
    assert replace(small, steps=4).key() != small.key()  # the recipe names the cache file


@pytest.mark.slow
def test_the_motif_source_learns_its_240_classes(cache_dir):
    """The real recipe (about five minutes on two cores, once per cache): the source knows its
    domain, as an ImageNet network knows ImageNet."""
    _, _, report = embedded_resnet.load_pretrained("embedded-motif-resnet", cache_dir)
    assert report["heldout_accuracy"] > 0.9 and report["source_classes"] == 240
    assert 1_250_000 < report["parameters"] < 1_300_000
