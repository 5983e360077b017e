"""A node's own settings are checked in one place before it does anything for a run."""

from __future__ import annotations

import pytest

from fedvlm.client_app.node_config import check_node_config
from fedvlm.runconfig import ConfigError


def test_the_settings_of_every_documented_node_pass(tmp_path):
    check_node_config({"partition-id": 0, "num-partitions": 3})  # Flower's simulation
    check_node_config(
        {
            "data-dir": str(tmp_path),
            "name": "org-0",
            "state-dir": str(tmp_path / "state"),
            "max-epsilon": "8",
            "delta": "1e-5",
            "noise-source": "os",
            "cache-dir": "~/.cache/fedvlm",
            "models": "ViT-B-16",
        }
    )


@pytest.mark.parametrize(
    "config,match",
    [
        ({"stat-dir": "/srv/state"}, "'stat-dir' is not a key this node knows: did you mean 'state-dir'"),
        ({"state-dir": "state"}, "relative path.*state-dir='/"),
        ({"data-dir": "./images"}, "relative path"),
        ({"partition-id": "abc", "num-partitions": 3}, "partition-id = 'abc' is not a whole number"),
        ({"partition-id": 1.5, "num-partitions": 3}, "not a whole number"),
        ({"max-epsilon": "inf", "state-dir": "/srv/state"}, "not a finite number"),
        ({"x" * 5000: 1}, r"'x{64}' is not a key"),
    ],
)
def test_a_setting_the_node_cannot_use_is_refused_with_its_fix(config, match):
    with pytest.raises(ConfigError, match=match):
        check_node_config(config)


def test_a_state_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "state").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_node_config({"state-dir": str(tmp_path / "state")})
