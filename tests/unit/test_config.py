"""Run-config validation: clear errors that name the key, the value and what is accepted;
and the schema and pyproject.toml agree (docs/configuration.md's key table: tests/unit/test_docs.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib

from fedvlm.methods.validation import validate
from fedvlm.runconfig import ConfigError
from fedvlm.runconfig.__main__ import main as runconfig_cli
from fedvlm.runconfig.schema import AUTO, DEFAULTS, KEYS, PrivacyConfig, PromptConfig

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_resolve_auto():
    cfg = validate({})
    assert cfg.dataset == "embedded" and cfg.partitioner == "pathological"
    assert Path(cfg.cache_dir).is_absolute() and Path(cfg.output_dir).is_absolute()


@pytest.mark.parametrize(
    "raw,fragments",
    [
        ({"method": "fedsomething"}, ["'method'", "fedsomething", "promptfl, coop, zeroshot"]),
        ({"prompt.lrr": 0.1}, ["unknown run-config key 'prompt.lrr'", "did you mean 'prompt.lr'"]),
        ({"prompt.lr": "fast"}, ["'prompt.lr'", "type float", "'fast'"]),
        ({"prompt.lr": -0.1}, ["'prompt.lr'", "-0.1", "must be > 0.0"]),
        ({"num-server-rounds": 2.5}, ["'num-server-rounds'", "type int"]),
        ({"download": 1}, ["'download'", "type bool"]),
        ({"fraction-train": 1.5}, ["'fraction-train'", "<= 1.0"]),
        ({"partitioner": "random"}, ["'partitioner'", "'random'", "'pathological'"]),
        ({"dataset": "imagenet"}, ["'dataset'", "'imagenet'", "'caltech101'"]),
        ({"dataset": "caltech101"}, ["'dataset'", "needs 'data-root'"]),
        ({"data-root": "relative/path", "dataset": "image-folder"}, ["'data-root'", "absolute"]),
        ({"output-dir": "runs"}, ["'output-dir'", "absolute"]),
        ({"quantity-ratios": "45:x"}, ["'quantity-ratios'", "'45:9:1'"]),
        ({"zeroshot.template": "a photo"}, ["'zeroshot.template'", "'{}'"]),
        # a 1 MB template was tokenised once per class on every client before any check
        ({"zeroshot.template": "{}" + "x" * 1_000_000}, ["'zeroshot.template'", "1000002 characters", "shorten"]),
        # the one sentinel is 'auto'; the old numeric ones are refused with the fix named
        ({"privacy.clip": -1.0}, ["'privacy.clip'", "-1.0", "must be > 0.0, or 'auto'"]),
        ({"prompt.local-steps": -1}, ["'prompt.local-steps'", "must be >= 0, or 'auto'"]),
        ({"fraction-train": 0.0}, ["'fraction-train'", "must be > 0.0, or 'auto'"]),
        ({"lora.lr": "fast"}, ["'lora.lr'", "type float or 'auto'", "'fast'"]),
        # values that would switch privacy off silently (the audit: nan ran without noise or cap)
        ({"privacy.epsilon": float("nan")}, ["'privacy.epsilon'", "nan", "finite"]),
        ({"privacy.max-epsilon": float("nan")}, ["'privacy.max-epsilon'", "finite"]),
        ({"privacy.epsilon": float("inf")}, ["'privacy.epsilon'", "inf", "finite"]),
        ({"privacy.noise-multiplier": float("nan")}, ["'privacy.noise-multiplier'", "finite"]),
        ({"privacy.clip": float("inf")}, ["'privacy.clip'", "finite"]),
        ({"privacy.delta": 1.0}, ["'privacy.delta'", "must be at most 0.1"]),
        ({"privacy.delta": 0.5}, ["'privacy.delta'", "must be at most 0.1"]),
        # values that would exhaust the machine before any error (issue 45)
        ({"privacy.audit-canaries": 10**9}, ["'privacy.audit-canaries'", "<= 100000"]),
        ({"prompt.n-ctx": 10**6}, ["'prompt.n-ctx'", "<= 72"]),
        ({"num-server-rounds": 10**20}, ["'num-server-rounds'", "<= 100000"]),
        ({"privacy.epsilon": 1e300}, ["'privacy.epsilon'", "<= 100"]),
        ({"privacy.delta": float("nan")}, ["'privacy.delta'", "finite"]),
        # Flower runs the apps wherever its processes started: a relative path would resolve there
        ({"clip.pretrained": "weights/vit.bin"}, ["'clip.pretrained'", "relative path"]),
        ({"clip.pretrained": "vit.safetensors"}, ["'clip.pretrained'", "relative path"]),
        ({"method": "fedrand", "vlm.model": "./my-llava"}, ["'vlm.model'", "relative path"]),
        # a run folder is one name inside output-dir (issue 45: these wrote outside it, or nowhere)
        ({"run-name": "../x"}, ["'run-name'", "one folder name"]),
        ({"run-name": "/tmp/x"}, ["'run-name'", "one folder name"]),
        ({"run-name": "x" * 5000}, ["'run-name'", "(5,002 characters)", "one folder name"]),
        ({"quantity-ratios": "1:nan"}, ["'quantity-ratios'", "positive finite numbers"]),
    ],
)
def test_errors_name_key_value_and_fix(raw, fragments):
    with pytest.raises(ConfigError) as err:
        validate(raw)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_config_is_typed_sections_with_one_sentinel():
    cfg = validate({"method": "dpfpl", "privacy.epsilon": 1.0, "prompt.lr": 0.002})
    assert isinstance(cfg.prompt, PromptConfig) and isinstance(cfg.privacy, PrivacyConfig)
    assert cfg.prompt.lr == 0.002 and cfg.privacy.clip == 10.0 and cfg.prompt.local_steps == 1
    assert cfg.privacy.enabled and not validate({}).privacy.enabled
    # 'auto' is the only "someone else decides" value, and every numeric one is resolved
    auto = [k.name for k in KEYS if k.default == AUTO]
    assert {"fraction-train", "dirichlet-alpha", "prompt.local-steps", "privacy.clip", "lora.lr"} <= set(auto)
    assert not [k.name for k in KEYS if k.auto and cfg.as_dict()[k.name] == AUTO]
    # the flat form round-trips (results.json records it; a resumed or shadow run re-validates it)
    assert validate(cfg.as_dict()) == cfg
    # an explicit value stands where 'auto' would have chosen another
    assert validate({"method": "dpfpl", "privacy.clip": 0.5, "fraction-train": 0.5}).privacy.clip == 0.5


def test_pyproject_lists_exactly_the_schema_with_same_defaults():
    app_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    assert dict(flat(app_cfg)) == DEFAULTS


def test_cli_check_names_the_bad_key(capsys):
    assert runconfig_cli(["check", "-c", "prompt.lrr=0.1"]) == 2
    assert "did you mean 'prompt.lr'" in capsys.readouterr().err
    assert runconfig_cli(["check", "-c", "method='coop' prompt.lr=0.002"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"prompt.lr = 0.002", out)


@pytest.mark.parametrize(
    "given, words",
    [
        (["nope.toml"], "nope.toml cannot be read (No such file"),
        (["folder.toml"], "folder.toml cannot be read (Is a directory"),
        (["binary.toml"], "binary.toml is not a TOML file"),
        (["list.toml"], "list.toml is not a TOML file"),
        (["seed=1", "list.toml"], "cannot be passed alongside"),
        (["seed = 5"], "'seed = 5' is not KEY=VALUE"),  # Flower dropped it: seed 0, exit 0
        (["seed=1 junk"], "'junk' is not KEY=VALUE"),
        (["method"], "'method' is not KEY=VALUE"),
        (["method='coop' method='promptfl'"], "a key given twice"),
        (["method='fedrand' vlm.language-model-pattern='(('"], "is not a regular expression"),
    ],
)
def test_cli_check_names_what_it_cannot_read(tmp_path, monkeypatch, capsys, given, words):
    """Each of these ended in a traceback, or was dropped without a word (found by a second attacker)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.toml").mkdir()
    (tmp_path / "binary.toml").write_bytes(b"\x80\xff")
    (tmp_path / "list.toml").write_text("seed = [1, 2]\n")
    assert runconfig_cli(["check", *(a for g in given for a in ("-c", g))]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("method", ["dpfpl", "fedotp", "fedpgp"])
def test_a_global_local_method_refuses_a_class_specific_context_at_validation(method):
    """Its server averages one shared context's gradient: refused by the method's own check, with
    the fix, before any strategy or node is built."""
    with pytest.raises(ConfigError, match=r"needs a shared context: set prompt.class-specific=false"):
        validate({"method": method, "prompt.class-specific": True})
    assert validate({"method": method}).prompt.class_specific is False


def test_a_run_made_before_a_key_existed_resumes_as_its_default():
    """results.json of an older fedvlm lacks a key added since: the run ran as the key's default
    says, so resuming it with the default is no difference, and with another value is one."""
    from fedvlm.server_app.resume import config_differences

    now = validate({"method": "promptfl"}).as_dict()
    saved = json.loads(json.dumps({k: v for k, v in now.items() if k != "evaluate-every"}))
    assert config_differences(saved, now) == []
    assert config_differences(saved, {**now, "evaluate-every": 2}) == ["evaluate-every = 1 (now 2)"]
