"""What a real node lets the run config choose (client_app.node_policy): no code to import and no
path of its own machine unless its node config allows it; a simulated node is left alone."""

from __future__ import annotations

import hashlib

import pytest

from fedvlm.client_app.node_policy import allowed_models, for_node
from fedvlm.methods.validation import validate
from fedvlm.runconfig import ConfigError
from fedvlm.utils.runtime import in_process_node


def _cfg(**values):
    return validate({"method": "promptfl", **values})


def test_the_defaults_pass_and_the_cache_is_the_nodes_own(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDVLM_CACHE", str(tmp_path / "env-cache"))
    cfg = _cfg(**{"cache-dir": "/server/side/cache"})
    assert for_node(cfg, {}).cache_dir == str(tmp_path / "env-cache")  # never the run config's
    assert for_node(cfg, {"cache-dir": str(tmp_path / "mine")}).cache_dir == str(tmp_path / "mine")
    with pytest.raises(ConfigError, match="node config cache-dir = 'relative': give an absolute path"):
        for_node(cfg, {"cache-dir": "relative"})


@pytest.mark.parametrize(
    "key, value",
    [
        ("data-root", {"dataset": "image-folder", "data-root": "/etc"}),
        ("data-root", {"dataset": "cifar10", "data-root": "/srv/cifar", "download": True}),
        ("vlm.ood-captions", {"method": "fedrand", "vlm.ood-captions": "/home/org/captions.json"}),
    ],
)
def test_keys_that_read_or_write_the_nodes_disk_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"run config '{key}' = .*this node"):
        for_node(_cfg(**value), {})
    with in_process_node():  # a simulation: the researcher's own machine and config
        assert for_node(_cfg(**value), {}) == _cfg(**value)


def test_a_path_in_the_run_config_is_never_opened(tmp_path):
    weights = tmp_path / "clip.pt"
    weights.write_bytes(b"not really weights")
    cfg = _cfg(**{"clip.model": "ViT-B-16", "clip.pretrained": str(weights)})
    with pytest.raises(
        ConfigError, match=r"'clip.pretrained' = .*clip\.pt.*loads only .*node config models names \(none\)"
    ):
        for_node(cfg, {})
    # named by the organisation: the run config names it, the node loads its own file, hash checked
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    node = {"models": f"vitb16-ours={weights}#sha256:{digest}"}
    mine = for_node(_cfg(**{"clip.model": "ViT-B-16", "clip.pretrained": "vitb16-ours"}), node)
    assert mine.clip.pretrained == str(weights)
    weights.write_bytes(b"swapped")
    with pytest.raises(ConfigError, match="has sha256 .* not the .* its node config models pins"):
        for_node(_cfg(**{"clip.model": "ViT-B-16", "clip.pretrained": "vitb16-ours"}), node)
    # open_clip's own architectures with their published tags are the library's
    assert for_node(_cfg(**{"clip.model": "ViT-B-16", "clip.pretrained": "openai"}), {}).clip.pretrained == "openai"
    with pytest.raises(ConfigError, match="'clip.model' = 'hf-hub:evil/model'"):
        for_node(_cfg(**{"clip.model": "hf-hub:evil/model"}), {})


def test_remote_code_needs_the_node_configs_consent_and_a_named_model(tmp_path):
    folder = tmp_path / "vlm"
    folder.mkdir()
    (folder / "modeling_evil.py").write_text("raise SystemExit('imported')\n")
    asks = {"method": "fedrand", "vlm.model": str(folder), "vlm.trust-remote-code": True}
    with pytest.raises(ConfigError, match="'vlm.trust-remote-code' = True: it runs the model's own Python"):
        for_node(validate(asks), {})
    with pytest.raises(ConfigError, match=r"'vlm.model' = .*vlm.*loads only"):
        for_node(validate({**asks, "vlm.trust-remote-code": False}), {})
    node = {"models": f"our-llava={folder}", "trust-remote-code": True}
    with pytest.raises(ConfigError, match="trust-remote-code"):  # the path is not the name
        for_node(validate(asks), node)
    mine = for_node(validate({**asks, "vlm.model": "our-llava"}), node)
    assert mine.vlm.model == str(folder) and mine.vlm.trust_remote_code
    hub = for_node(validate({"method": "fedrand", "vlm.model": "org/vlm"}), {"models": "org/vlm"})
    assert hub.vlm.model == "org/vlm"  # a hub id the organisation allows, downloaded from its hub


def test_source_weights_files_come_from_the_node(tmp_path):
    state = tmp_path / "resnet.pt"
    state.write_bytes(b"x")
    asks = {"method": "reprogram", "reprogram.source-weights": str(state)}
    with pytest.raises(ConfigError, match="'reprogram.source-weights'"):
        for_node(validate(asks), {})
    node = {"models": f"ours={state}"}
    assert for_node(validate({**asks, "reprogram.source-weights": "ours"}), node).reprogram.source_weights == str(state)
    assert (
        for_node(validate({**asks, "reprogram.source-weights": "imagenet"}), {}).reprogram.source_weights == "imagenet"
    )


def test_the_allow_list_is_parsed_strictly():
    digest = "a" * 64
    parsed = allowed_models({"models": f"org/vlm, ours = /m/x.pt#sha256:{digest.upper()}"})
    assert parsed["org/vlm"].path is None and parsed["ours"].sha256 == digest
    for bad in ("x=relative/path", "x=/a#md5:12", "x=/a#sha256:12"):
        with pytest.raises(ConfigError, match="node config models"):
            allowed_models({"models": bad})
