"""Progress bars on a terminal, nothing in a log (CI, ``flwr run --stream``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from fedvlm.utils.progress import time_left

CODE = "from fedvlm.utils.progress import each\nfor _ in each(range(5), 'pretraining x'):\n    pass\n"


def _stderr(code: str = CODE, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("FEDVLM_PROGRESS", "CI")} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, check=True).stderr


def test_a_log_gets_no_bar_and_a_forced_one_shows_its_count():
    assert _stderr() == ""  # stderr is a pipe here, as in CI: quiet
    assert _stderr(FEDVLM_PROGRESS="0") == ""
    shown = _stderr(FEDVLM_PROGRESS="1")
    assert "pretraining x" in shown and "/5 [" in shown  # its count of 5 steps


def test_time_left_is_the_mean_time_per_unit_times_the_units_left():
    assert time_left(2, 10, 20.0) == "about 80 s left"
    assert time_left(1, 10, 60.0) == "about 9 min left"
    assert time_left(0, 10, 5.0) == "" and time_left(10, 10, 5.0) == ""


@pytest.mark.slow  # 13 s: loads the tiny VLM in a subprocess
def test_a_client_loading_the_vlm_in_a_log_prints_nothing(vlm_cache):
    """Every client of a VLM run loads the model and wraps it: no transformers bar, no peft warning
    about transformers' deprecated alias, in a log; a forced bar still shows the load."""
    code = (
        "from pathlib import Path\n"
        "from fedvlm.models.vlm import AdapterSpec, add_adapter, load_model_and_processor\n"
        f"model, _ = load_model_and_processor('embedded-tiny-vlm', Path({str(vlm_cache)!r}))\n"
        "add_adapter(model, AdapterSpec(kind='lora', rank=2, alpha=4.0, dropout=0.0, targets=('q_proj',)), seed=0)\n"
    )
    assert _stderr(code) == ""
    assert "Loading weights" in _stderr(code, FEDVLM_PROGRESS="1")


def test_a_baseline_client_building_its_network_logs_nothing(tmp_path, caplog):
    """Opacus says at INFO, once per BatchNorm it replaces, that it replaced it: every BL-FF/BL-TS
    client of every round would repeat it in the run's log."""
    from fedvlm.models import embedded_resnet
    from fedvlm.models.reprogram import FineTuneNet, load_source

    source = load_source(next(iter(embedded_resnet.SOURCES)), "random", tmp_path)
    with caplog.at_level(logging.INFO):
        net = FineTuneNet(source, 3, "ff")
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())  # replaced all the same
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opacus")] == []
