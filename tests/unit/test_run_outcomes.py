"""A run folder never lies about how a run ended: a refused config leaves a failed run (not the
previous run's verdict), results.json is strict JSON, and a full disk still ends the run as
failed with its error."""

from __future__ import annotations

import errno
import json

import pytest

from fedvlm.runconfig import ConfigError
from fedvlm.server_app.app import run
from fedvlm.server_app.results import RunRecorder
from fedvlm.status import check
from fedvlm.status import main as status_main
from fedvlm.strategies.records import TRAFFIC_KEYS


def test_a_refused_config_leaves_a_failed_run_that_status_reports(tmp_path, capsys):
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "results.json").write_text(json.dumps({"run": {"status": "finished"}, "rounds": []}))
    with pytest.raises(ConfigError):
        run({"method": "fedsomething", "output-dir": str(tmp_path)}, None, 42)
    assert status_main(["--runs", str(tmp_path)]) == 1  # not the earlier, finished run
    assert "invalid run config" in capsys.readouterr().out


def test_results_are_strict_json(tmp_path):
    recorder = RunRecorder(tmp_path / "r", {"x": 1}, {"method": "promptfl"})
    recorder.add_round({"round": 1, "metrics": {"train-loss": float("inf"), "local-acc": float("nan")}})
    text = (tmp_path / "r" / "results.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text)["rounds"][0]["metrics"] == {"train-loss": None, "local-acc": None}


def test_a_full_disk_still_ends_the_run_failed_with_its_error(tmp_path, monkeypatch):
    from fedvlm.server_app import results

    recorder = RunRecorder(tmp_path / "r", {"num-server-rounds": 3}, {"method": "promptfl"})

    def no_space(text, path, durable=False):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results, "atomic_write_text", no_space)  # results.json and rounds.csv
    with pytest.raises(OSError):
        recorder.add_round({"round": 1, "metrics": {}, **dict.fromkeys(TRAFFIC_KEYS, 0)})
    recorder.finish("failed", "OSError: [Errno 28] No space left on device")
    assert json.loads((tmp_path / "r" / "results.json").read_text())["run"]["status"] == "running"  # never rewritten
    verdict = check(tmp_path / "r")
    assert verdict.code == 1 and "No space left on device" in verdict.reason
