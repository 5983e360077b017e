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
    # it names the file open_clip wants and where a download would put it
    assert "timm/vit_base_patch32_clip_224.openai" in str(err.value) and "open_clip_model.safetensors" in str(err.value)
    assert "clip.pretrained='/absolute/path/to/it'" in str(err.value)


def test_local_checkpoint_file_loads(tmp_path):
    import open_clip

    model = open_clip.create_model("ViT-B-32", pretrained=None)
    path = tmp_path / "vit-b-32.pt"
    torch.save(model.state_dict(), path)
    b = load_clip("ViT-B-32", str(path), tmp_path, "cpu")
    assert b.fingerprint.startswith("ViT-B-32:gelu:sha256:")
    assert b.embed_dim == 512
    for k, v in model.state_dict().items():
        assert torch.equal(b.model.state_dict()[k], v)


def test_cuda_request_without_gpu_is_clear():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(BackboneError, match="no CUDA device"):
        clip_loader.resolve_device("cuda")


# ---- what was loaded: the activation the weights were trained with, and a fingerprint of it ----


def _activations(model) -> set[str]:
    import open_clip.transformer as t

    return {
        "quick-gelu" if isinstance(m, t.QuickGELU) else "gelu"
        for m in model.modules()
        if isinstance(m, (t.QuickGELU, torch.nn.GELU))
    }


def _presets() -> list[tuple[str, str]]:
    from fedvlm.experiments.presets import PRESETS

    found = {(p["clip.model"], p["clip.pretrained"]) for p in PRESETS.values() if p.get("clip.pretrained")}
    return sorted(found | {("ViT-B-16", "openai")})  # and docs/configuration.md's example


@pytest.mark.parametrize("name,tag", _presets())
def test_every_preset_builds_the_activation_its_weights_were_trained_with(name, tag, tmp_path):
    """open_clip 3.x builds ViT-B-16 + openai with GELU and loads QuickGELU-trained weights into it."""
    import open_clip

    model, _, _, act = clip_loader._load_open_clip(name, tag, tmp_path, load_weights=False)
    trained_with = "quick-gelu" if open_clip.get_pretrained_cfg(name, tag).get("quick_gelu") else "gelu"
    assert act == trained_with and _activations(model) == {trained_with}


def test_a_file_beside_its_hugging_face_config_takes_the_activation_it_names(tmp_path):
    import json

    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": {"quick_gelu": True}}))
    weights = tmp_path / "open_clip_model.safetensors"
    assert clip_loader.activation_of("ViT-B-16", str(weights), weights) == "quick-gelu"
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": {}}))
    with pytest.raises(BackboneError, match="says its weights were trained with GELU"):
        clip_loader.activation_of("ViT-B-16-quickgelu", str(weights), weights)
    alone = tmp_path / "elsewhere" / "w.bin"
    assert clip_loader.activation_of("ViT-B-16-quickgelu", str(alone), alone) == "quick-gelu"


def test_the_fingerprint_is_what_was_loaded_not_its_name_or_file(tmp_path):
    import open_clip
    from safetensors.torch import save_file

    model = open_clip.create_model("ViT-B-32", pretrained=None)
    torch.save(model.state_dict(), tmp_path / "w.bin")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "w.safetensors")
    clip_loader._CACHE.clear()
    a = load_clip("ViT-B-32", str(tmp_path / "w.bin"), tmp_path, "cpu").fingerprint
    b = load_clip("ViT-B-32", str(tmp_path / "w.safetensors"), tmp_path, "cpu").fingerprint
    assert a == b  # the same weights in two formats
    # random initialisation is seeded: every process builds the same weights, so nodes agree
    first = load_clip("ViT-B-32", "", tmp_path, "cpu").fingerprint
    clip_loader._CACHE.clear()
    assert load_clip("ViT-B-32", "", tmp_path, "cpu").fingerprint == first != a
    with pytest.raises(BackboneError, match="relative path"):
        load_clip("ViT-B-32", "weights/w.bin", tmp_path, "cpu")


def test_openai_torchscript_and_the_standard_hugging_face_cache_load_offline(tmp_path, monkeypatch):
    """OpenAI's original TorchScript file (what the `clip` package caches) loads as QuickGELU, and
    a tag's weights already in $HF_HOME/hub are found without network."""
    import open_clip
    from safetensors.torch import save_file

    monkeypatch.setattr(clip_loader, "_hub_reachable", lambda *a, **k: False)
    # OpenAI's files hold float16 weights (open_clip loads them through float16)
    reference = open_clip.create_model("RN50-quickgelu", pretrained=None).eval().half().float()
    image = torch.randn(1, 3, 224, 224)
    traced = open_clip.create_model("RN50-quickgelu", pretrained=None).eval()
    traced.load_state_dict(reference.state_dict())
    del traced.attn_mask  # not in OpenAI's files: their text mask is built, not stored
    scripted = torch.jit.trace_module(traced, {"encode_image": image})
    torch.jit.save(scripted, tmp_path / "RN50.pt")
    with pytest.raises(Exception, match="weights_only|TorchScript|archive"):  # what users hit before
        torch.load(tmp_path / "RN50.pt", weights_only=True)
    clip_loader._CACHE.clear()
    b = load_clip("RN50", str(tmp_path / "RN50.pt"), tmp_path, "cpu")
    assert b.fingerprint.startswith("RN50:quick-gelu:") and _activations(b.model) == {"quick-gelu"}
    loaded = b.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in reference.state_dict().items() if k != "attn_mask")
    torch.testing.assert_close(b.model.encode_image(image), reference.encode_image(image), atol=1e-4, rtol=1e-3)

    hub = tmp_path / "hf" / "hub" / "models--timm--resnet50_clip.openai"
    (hub / "refs").mkdir(parents=True)
    (hub / "refs" / "main").write_text("0" * 40)
    snapshot = hub / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, snapshot / "open_clip_model.safetensors")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    clip_loader._CACHE.clear()
    c = load_clip("RN50", "openai", tmp_path / "project-cache", "cpu")
    assert c.fingerprint == b.fingerprint  # the same weights, from another format and place
