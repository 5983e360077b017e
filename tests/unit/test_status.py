"""python -m fedvlm.status: the exit status a script can test, and the reason it prints."""

from __future__ import annotations

import json
import os
import time

import pytest
from flwr.app import Error, Message

from fedvlm import status
from fedvlm.client_app.app import app as client_app
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid


def _write(folder, run: dict, rounds: list[dict], total: int = 2):
    folder.mkdir(parents=True, exist_ok=True)
    data = {"config": {"num-server-rounds": total}, "run": run, "rounds": rounds, "final": {}}
    (folder / "results.json").write_text(json.dumps(data))
    return folder


def _round(sampled: int, trained: int) -> dict:
    return {"round": 1, "sampled": sampled, "metrics": {"train-clients": trained}}


@pytest.mark.parametrize(
    "run,rounds,code,words",
    [
        ({"status": "finished"}, [_round(4, 4), _round(4, 3)], status.OK, "heard from 3 of 4"),
        ({"status": "finished"}, [_round(4, 4), _round(4, 1)], status.LOST_NODES, "lost 3 of 4"),
        ({"status": "failed", "note": "RuntimeError: boom"}, [_round(4, 4)], status.FAILED, "RuntimeError: boom"),
        ({"status": "stopped", "note": "privacy budget reached"}, [_round(4, 4)], status.STOPPED, "privacy budget"),
        ({"status": "running"}, [_round(4, 4)], status.UNFINISHED, "1 of 2 rounds"),
        ({"status": "interrupted", "note": "SystemExit; continue it with resume="}, [], status.UNFINISHED, "resume="),
    ],
)
def test_each_outcome_has_its_exit_status_and_reason(tmp_path, capsys, run, rounds, code, words):
    folder = _write(tmp_path / "r", run, rounds)
    assert status.main([str(folder)]) == code
    assert words in capsys.readouterr().out


def test_a_run_that_is_not_there_or_unreadable_is_exit_2(tmp_path, capsys):
    assert status.main([str(tmp_path / "missing")]) == status.UNREADABLE
    assert status.main(["--runs", str(tmp_path)]) == status.UNREADABLE
    assert "no run folder" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "results.json").write_text("{")
    assert status.main([str(tmp_path / "half")]) == status.UNREADABLE


def test_without_a_folder_it_reads_the_newest_run(tmp_path, capsys):
    old = _write(tmp_path / "old", {"status": "failed", "note": "x"}, [])
    _write(tmp_path / "new", {"status": "finished"}, [_round(2, 2)])
    past = time.time() - 100
    os.utime(old / "results.json", (past, past))
    assert status.main(["--runs", str(tmp_path)]) == status.OK
    assert str(tmp_path / "new") in capsys.readouterr().out
    with pytest.raises(SystemExit):
        status.main([str(tmp_path / "new"), "--max-lost", "2"])


def test_a_real_run_that_loses_its_clients_exits_non_zero(make_cfg, pretrained_clip):
    """Two of three clients answer every train message with an error: the run finishes, and the
    status command says it lost them."""

    def fail_two(request: Message, reply: Message) -> Message:
        if request.metadata.dst_node_id != 1000 and request.metadata.message_type == "train":
            return Message(Error(code=1, reason="RuntimeError: disk full"), reply_to=request)
        return reply

    cfg = make_cfg(method="promptfl", num_server_rounds=2, max_per_class=1)
    nodes = [{"partition-id": i, "num-partitions": 3} for i in range(3)]
    rec = execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict(), intercept=fail_two), run_id="t")
    result = status.check(rec.dir)
    assert result.code == status.LOST_NODES and "lost 2 of 3" in result.reason
    assert status.check(rec.dir, max_lost=0.7).code == status.OK
