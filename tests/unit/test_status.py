"""python -m fedvlm.status: the exit status a script can test, and the reason it prints."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from flwr.app import Error, Message

from fedvlm import status
from fedvlm.client_app.app import app as client_app
from fedvlm.runconfig import ConfigError
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid


def _write(folder, run: dict, rounds: list[dict], total: int = 2):
    folder.mkdir(parents=True, exist_ok=True)
    data = {"config": {"num-server-rounds": total}, "run": run, "rounds": rounds, "final": {}}
    (folder / "results.json").write_text(json.dumps(data))
    return folder


def _round(sampled: int, trained: int, r: int = 1) -> dict:
    return {"round": r, "sampled": sampled, "metrics": {"train-clients": trained}}


@pytest.mark.parametrize(
    "run,rounds,code,words",
    [
        ({"status": "finished"}, [_round(4, 4), _round(4, 3)], status.OK, "heard from 3 of 4"),
        ({"status": "finished"}, [_round(4, 4), _round(4, 1, 2)], status.LOST_NODES, "round 2 lost 3 of 4"),
        # a round lost mid-run (a node restarted, its reply refused) is judged too, not only the last
        ({"status": "finished"}, [_round(4, 1), _round(4, 4, 2)], status.LOST_NODES, "round 1 lost 3 of 4"),
        ({"status": "finished"}, [_round(4, 3), _round(4, 4, 2)], status.OK, "clients lost: round 1 lost 1 of 4"),
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


_CONSISTENT = {"status": "consistent: the audited lower bound does not exceed the accounted epsilon"}


@pytest.mark.parametrize(
    "audit,code,words",
    [
        ({"nodes": {"client-0": _CONSISTENT}}, status.OK, "heard from 4 of 4"),
        (
            {"nodes": {"client-0": {"status": "BROKEN: the audit proves epsilon >= 3"}}},
            status.AUDIT,
            "client-0: BROKEN",
        ),
        ({"status": "MISSING: privacy.audit-canaries = 20 asked for an audit"}, status.AUDIT, "MISSING"),
        # hand-edited or damaged sections fail nothing they do not say
        ("MISSING", status.OK, "heard from"),
        ({"nodes": ["BROKEN"]}, status.OK, "heard from"),
        ({"nodes": {"client-0": "BROKEN"}}, status.OK, "heard from"),
    ],
)
def test_a_finished_run_whose_audit_is_missing_or_broken_exits_6(tmp_path, capsys, audit, code, words):
    folder = _write(tmp_path / "r", {"status": "finished"}, [_round(4, 4), _round(4, 4, 2)])
    data = json.loads((folder / "results.json").read_text())
    (folder / "results.json").write_text(json.dumps({**data, "audit": audit}))
    assert status.main([str(folder)]) == code
    assert words in capsys.readouterr().out


def test_a_running_folder_whose_serverapp_is_gone_reads_interrupted_and_stop_records_it(tmp_path, capsys):
    """A folder saying "running" is running only while a process holds its lock (the ServerApp's
    hold_run_dir); once that process is gone (stopped, killed), status says interrupted, and
    fedvlm.stop's record_interrupted writes that into the folder, with the resume that continues it."""
    import subprocess
    import sys

    from fedvlm.stop import record_interrupted, run_dirs_held_by

    traffic = {"train_bytes_up": 10, "train_bytes_down": 20, "evaluate_bytes_up": 0, "evaluate_bytes_down": 20}
    recorded = {**_round(4, 4), **traffic}  # as RunRecorder.add_round keeps it
    folder = _write(tmp_path / "r", {"status": "running", "started": "2026-11-27T10:00:00+00:00"}, [recorded])
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from fedvlm.utils.files import try_hold; "
            f"h = try_hold({str(folder / status.RUN_LOCK)!r}); print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert status.held(folder) is True and run_dirs_held_by([holder.pid]) == {folder}
        assert status.main([str(folder)]) == status.UNFINISHED
        assert "still running, or killed" in capsys.readouterr().out
        assert record_interrupted([folder]) == [f"{folder}: still held by a running ServerApp, left as it is"]
    finally:
        holder.kill()
        holder.wait()
    assert status.held(folder) is False and status.held(tmp_path) is None  # no lock file: unknown
    assert status.main([str(folder)]) == status.UNFINISHED
    assert "ended without finishing" in capsys.readouterr().out
    assert record_interrupted([folder]) == [f"{folder}: interrupted after round 1; continue it with resume='{folder}'"]
    data = json.loads((folder / "results.json").read_text())
    assert data["run"]["status"] == "interrupted" and f"resume='{folder}'" in data["run"]["note"]
    assert data["final"]["rounds"] == 1 and json.loads((folder / "status.json").read_text())["status"] == "interrupted"
    assert record_interrupted([folder]) == []  # already recorded: nothing to do


def test_a_run_that_is_not_there_or_unreadable_is_exit_2(tmp_path, capsys):
    assert status.main([str(tmp_path / "missing")]) == status.UNREADABLE
    assert status.main(["--runs", str(tmp_path)]) == status.UNREADABLE
    assert "no run folder" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "results.json").write_text("{")
    assert status.main([str(tmp_path / "half")]) == status.UNREADABLE
    # binary bytes, a list, a record without its rounds; and a side file that is not an object
    (tmp_path / "half" / "status.json").write_text("[1]")
    for body, words in (
        (b"\x80\xff", "not valid UTF-8 JSON"),
        (b"[]", "JSON list"),
        (b'{"run": {}, "config": {}}', "'rounds' is missing"),
    ):
        (tmp_path / "half" / "results.json").write_bytes(body)
        capsys.readouterr()
        assert status.main([str(tmp_path / "half")]) == status.UNREADABLE
        said = capsys.readouterr()
        assert "results.json" in said.out + said.err and words in said.out + said.err


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("rounds", [1, 2], "rounds[0] is not an object"),
        ("sampled", "x", "rounds[0].sampled = 'x' is not a whole number"),
        ("sampled", 1e400, "is not a whole number"),
        ("metrics", None, "rounds[0] is not an object with an object of 'metrics'"),
        ("excluded", ["a"], "run.excluded_nodes is not an object"),
        ("excluded", {"1": {"x": 1}}, "run.excluded_nodes is not an object"),
        ("rounds", [], "says the run finished but records no round"),
    ],
)
def test_a_damaged_field_is_exit_2_naming_it(tmp_path, capsys, field, value, words):
    """A hand-edited or damaged results.json ended in a traceback (exit 1, 'failed') or, with no
    round at all, in 'finished 0 of 20 rounds' and exit 0 (found by a second attacker)."""
    data = {"config": {"num-server-rounds": 2}, "run": {"status": "finished"}, "rounds": [{"round": 1, "sampled": 2}]}
    if field == "rounds":
        data["rounds"] = value
    elif field == "excluded":
        data["run"]["excluded_nodes"] = value
    else:
        data["rounds"][0][field] = value
    (tmp_path / "results.json").write_text(json.dumps(data).replace("Infinity", "1e400"))
    assert status.main([str(tmp_path)]) == status.UNREADABLE
    assert words in capsys.readouterr().out


@pytest.mark.parametrize("at", ["soon", 1e300, None])
def test_a_refusal_whose_time_is_unreadable_is_still_the_newest_word(tmp_path, capsys, at):
    data = {"config": {"num-server-rounds": 1}, "run": {"status": "finished"}, "rounds": [{"round": 1}]}
    (tmp_path / "results.json").write_text(json.dumps(data))
    (tmp_path / "resume-refused.json").write_text(json.dumps({"at": at, "reason": "the config differs"}))
    assert status.main([str(tmp_path)]) == status.FAILED
    assert "a resume was refused at" in capsys.readouterr().out


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


def test_a_run_pinned_to_other_backbone_weights_fails_before_round_1(make_cfg, pretrained_clip):
    """``backbone-fingerprint``: a server on other weights refuses the run before any node trains,
    naming both and the fix; the weights it loads, whole or by their 16 hex digits, pass."""
    with pytest.raises(ConfigError, match="'backbone-fingerprint' = ' 37eb0eb99a459465': must be a fingerprint as"):
        make_cfg(backbone_fingerprint=" 37eb0eb99a459465")  # refused as it is read, not at the server's start
    nodes = [{"partition-id": i, "num-partitions": 2} for i in range(2)]
    cfg = make_cfg(method="promptfl", num_server_rounds=1, max_per_class=1, backbone_fingerprint="0123456789abcdef")
    with pytest.raises(ConfigError, match=r"'0123456789abcdef', but this server loads embedded-tiny:gelu:sha256:"):
        execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id="pinned")
    failed = status.check(next(Path(cfg.output_dir).glob("*pinned*")))
    assert failed.code == status.FAILED and "cache-dir's models/" in failed.reason and "0 of 1 rounds" in failed.reason
    loaded = json.loads((next(Path(cfg.output_dir).glob("*pinned*")) / "results.json").read_text())
    whole = loaded["run"]["backbone"]["fingerprint"]
    for pin in (whole, whole.rsplit(":", 1)[-1]):
        cfg = make_cfg(method="promptfl", num_server_rounds=1, max_per_class=1, backbone_fingerprint=pin)
        rec = execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id="pinned-right")
        assert status.check(rec.dir).code == status.OK


def test_a_full_disk_at_the_start_or_the_end_fails_the_run_with_the_reason(make_cfg, pretrained_clip, monkeypatch):
    """No space for results.json: at the start the ServerApp stops with an error naming the folder
    and the fix, and the status file made first keeps the reason (status 1, not 'running'); at the
    end (the summary and the plots cannot be written) the run is failed with the reason, not
    'finished' without its outputs."""
    import errno

    import fedvlm.plots as plots
    from fedvlm.server_app import results

    real = results.atomic_write_text

    def full_disk(when):
        def write(text, path, durable=False):
            if Path(path).name == "results.json" and when(json.loads(text)):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            real(text, path, durable)

        return write

    cfg = make_cfg(method="promptfl", num_server_rounds=2, max_per_class=1, run_name="full-at-start")
    nodes = [{"partition-id": i, "num-partitions": 2} for i in range(2)]
    monkeypatch.setattr(results, "atomic_write_text", full_disk(lambda data: True))
    with pytest.raises(OSError, match="cannot write the run folder .*full-at-start.*free space on its disk"):
        execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id="t")
    folder = Path(cfg.output_dir) / "full-at-start"
    assert not (folder / "results.json").exists()
    verdict = status.check(folder)
    assert verdict.code == status.FAILED and "No space left on device" in verdict.reason, verdict

    cfg = make_cfg(method="promptfl", num_server_rounds=2, max_per_class=1, run_name="full-at-end")
    monkeypatch.setattr(results, "atomic_write_text", full_disk(lambda data: "ended" in data["run"]))

    def no_room(data, out_dir):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plots, "draw_run", no_room)
    rec = execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id="t")
    assert len(json.loads(rec.path.read_text())["rounds"]) == 2  # every round was written before the end
    verdict = status.check(rec.dir)
    assert verdict.code == status.FAILED, verdict
    assert "every round finished, but results.json could not be written" in verdict.reason, verdict


def test_stop_says_when_flowers_local_port_is_another_accounts(tmp_path, capsys, monkeypatch):
    """`flwr run .` joins whatever local SuperLink answers on Flower's port: a second account's run
    landed in the first account's SuperLink, and `python -m fedvlm.stop` said "nothing to stop"
    and exited 0 while that run went on."""
    import shutil
    import socket
    import subprocess
    import sys

    from fedvlm import stop
    from fedvlm.utils.processes import free_port, listener_uid

    # another home's SuperLink is not this one's, even where this home's path ends like it
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "flower-superlink", f"{tmp_path}/x/local-superlink/s.log"]
    )
    try:
        from fedvlm.utils.processes import cmdline

        deadline = time.time() + 10
        while "flower-superlink" not in cmdline(other.pid) and time.time() < deadline:  # exec'd yet?
            time.sleep(0.05)
        assert other.pid not in stop.local_superlinks(Path("/"))
        assert other.pid in stop.local_superlinks(tmp_path / "x")
    finally:
        other.kill()
        other.wait()
    port = free_port()
    monkeypatch.setenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", str(port))
    assert stop.main(["--flwr-home", str(tmp_path)]) == 0  # nothing listens: nothing to stop
    assert "nothing to stop" in capsys.readouterr().out
    with socket.socket() as mine:  # this account's own listener is not another's
        mine.bind(("127.0.0.1", port))
        mine.listen()
        assert listener_uid(port) == os.getuid() and stop.main(["--flwr-home", str(tmp_path)]) == 0
    if os.getuid() != 0:
        return  # only root can start a listener as another account here
    listen = f"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); time.sleep(60)"
    # a Python that account may run (this environment's may sit in a folder only its owner reads)
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    other = subprocess.Popen([python, "-c", listen], user=65534)
    try:
        deadline = time.time() + 20
        while listener_uid(port) is None and time.time() < deadline:
            time.sleep(0.1)
        capsys.readouterr()
        assert stop.main(["--flwr-home", str(tmp_path)]) == 1
        said = capsys.readouterr().err
        assert "another account's (uid 65534) holds Flower's local port" in said and "superlink --local" in said
    finally:
        other.kill()
