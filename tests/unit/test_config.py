"""Run-config validation: clear errors that name the key, the value and what is accepted;
and the schema, pyproject.toml and README agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from fedvlm.runconfig import ConfigError

from fedvlm.methods.registry import validate
from fedvlm.runconfig.__main__ import main as runconfig_cli
from fedvlm.runconfig.schema import DEFAULTS, KEYS

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_resolve_auto():
    cfg = validate({})
    assert cfg["dataset"] == "embedded" and cfg["partitioner"] == "pathological"
    assert Path(cfg["cache-dir"]).is_absolute() and Path(cfg["output-dir"]).is_absolute()


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
    ],
)
def test_errors_name_key_value_and_fix(raw, fragments):
    with pytest.raises(ConfigError) as err:
        validate(raw)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_pyproject_lists_exactly_the_schema_with_same_defaults():
    app_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    assert dict(flat(app_cfg)) == DEFAULTS


def test_readme_documents_every_key():
    readme = (ROOT / "README.md").read_text()
    missing = [k.name for k in KEYS if f"`{k.name}`" not in readme]
    assert not missing, f"README lacks keys: {missing}"


def test_cli_check_names_the_bad_key(capsys):
    assert runconfig_cli(["check", "-c", "prompt.lrr=0.1"]) == 2
    assert "did you mean 'prompt.lr'" in capsys.readouterr().err
    assert runconfig_cli(["check", "-c", "method='coop' prompt.lr=0.002"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"prompt.lr = 0.002", out)
