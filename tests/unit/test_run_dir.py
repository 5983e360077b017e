"""The run folder: a file where it would go is left alone, and an output-dir that is a file is
refused by its key (a NotADirectoryError ended the ServerApp with no folder to say why)."""

from __future__ import annotations

import pytest

from fedvlm.runconfig import ConfigError
from fedvlm.server_app.results import make_run_dir


def test_a_file_named_like_the_run_is_left_alone_and_a_file_for_output_dir_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "myrun").write_text("the user's")
    made = make_run_dir(str(tmp_path / "out"), "myrun", "coop", "embedded", 1)
    assert made.is_dir() and made.name.startswith("myrun-") and (tmp_path / "out" / "myrun").read_text() == "the user's"
    (tmp_path / "file").write_text("the user's")
    with pytest.raises(ConfigError, match=r"'output-dir' = .*file.*Not a directory.*name a folder"):
        make_run_dir(str(tmp_path / "file"), "x", "coop", "embedded", 1)
    assert (tmp_path / "file").read_text() == "the user's"
