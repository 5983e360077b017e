"""Backbone loading: the embedded tiny CLIP, open_clip names, tags and local files."""

from __future__ import annotations

import time

import pytest
import torch
from PIL import Image

from fedvlm.models import clip_loader
from fedvlm.models.clip_loader import BackboneError, load_clip


def test_embedded_clip_is_pretrained_cached_and_frozen(pretrained_clip, cache_dir):
    b = pretrained_clip
    assert b.fingerprint.startswith("embedded-tiny:")
    assert not any(p.requires_grad for p in b.model.parameters())
    assert list((cache_dir / "models").glob("embedded-tiny-*.pt"))
    # same object on a second call (loaded once per process)
    assert load_clip("embedded-tiny", "", cache_dir, "cpu") is b
    # any image size is brought to the model's input size
    assert b.preprocess(Image.new("RGB", (50, 50))).shape == (3, 32, 32)


def test_pretraining_is_deterministic(tmp_path):
    from fedvlm.models import tiny_clip

    recipe = tiny_clip.PretrainRecipe(steps=3, images_per_class=4)
    a = tiny_clip.pretrain(recipe, progress=False).state_dict()
    b = tiny_clip.pretrain(recipe, progress=False).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_architecture(tmp_path):
    with pytest.raises(BackboneError, match="not an open_clip architecture"):
        load_clip("ViT-Q-99", "openai", tmp_path, "cpu")


def test_unknown_tag_lists_the_known_ones(tmp_path):
    with pytest.raises(BackboneError, match="laion2b_s34b_b88k"):
        load_clip("ViT-B-16", "not-a-tag", tmp_path, "cpu")


def test_missing_local_checkpoint(tmp_path):
    with pytest.raises(BackboneError, match="no such file"):
        load_clip("ViT-B-16", str(tmp_path / "weights.bin"), tmp_path, "cpu")


def test_offline_download_fails_at_once_with_the_fix(tmp_path, monkeypatch):
    # No network and nothing in the local cache: fail in seconds, not after a minute of
    # retries, and say how to supply a local file.
    monkeypatch.setattr(clip_loader, "_hub_reachable", lambda *a, **k: False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    t0 = time.time()
    with pytest.raises(BackboneError) as err:
        load_clip("ViT-B-32", "openai", tmp_path, "cpu")
    assert time.time() - t0 < 30
    assert "clip.pretrained='/path/to/that/file'" in str(err.value)


def test_local_checkpoint_file_loads(tmp_path):
    import open_clip

    model = open_clip.create_model("ViT-B-32", pretrained=None)
    path = tmp_path / "vit-b-32.pt"
    torch.save(model.state_dict(), path)
    b = load_clip("ViT-B-32", str(path), tmp_path, "cpu")
    assert b.fingerprint.startswith("ViT-B-32:sha256:")
    assert b.embed_dim == 512
    for k, v in model.state_dict().items():
        assert torch.equal(b.model.state_dict()[k], v)


def test_cuda_request_without_gpu_is_clear():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(BackboneError, match="no CUDA device"):
        clip_loader.resolve_device("cuda")
