"""The warm node worker (client_app.worker, deploy.node_worker): a real worker process per node
runs an in-process federation's messages to the same numbers as the ClientApp itself, keeps the
model loaded between messages, refuses another node, and a lost or silent worker is a lost
reply, not a hang."""

from __future__ import annotations

import json
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from fedvlm.client_app.app import app as client_app
from fedvlm.client_app.worker import WorkerError, _receive, _send, forward, listen
from fedvlm.deploy.node_worker import spawn
from fedvlm.protocol import NODE_WORKER
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid
from fedvlm.utils.processes import kill_tree


@pytest.fixture
def workers(tmp_path):
    procs = []

    def start(n: int) -> list[Path]:
        paths = []
        for i in range(n):
            path = tmp_path / "worker" / f"node-{i}.sock"
            procs.append((spawn(path, tmp_path / f"worker-{i}.log"), tmp_path / f"worker-{i}.log"))
            paths.append(path)
        return paths

    yield start
    for proc, _ in procs:
        kill_tree(proc.pid)
        proc.wait(timeout=30)


def _rounds(rec) -> list[dict]:
    return [r["metrics"] for r in json.loads(rec.path.read_text())["rounds"]]


def _message(kind: str, node_id: int, config: dict | None = None) -> Message:
    return Message(RecordDict({"config": ConfigRecord(config or {})}), dst_node_id=node_id, message_type=kind)


def test_workers_run_a_federation_to_the_same_numbers_and_stay_warm(make_cfg, pretrained_clip, workers, tmp_path):
    cfg = make_cfg(method="promptfl", num_server_rounds=2, run_name="worker")
    paths = workers(2)
    nodes = [{"partition-id": i, "num-partitions": 2, NODE_WORKER: str(p)} for i, p in enumerate(paths)]
    warm = execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id="w")
    plain_cfg = make_cfg(method="promptfl", num_server_rounds=2, run_name="plain")
    plain_nodes = [{"partition-id": i, "num-partitions": 2} for i in range(2)]
    plain = execute(plain_cfg, InProcessGrid(client_app, plain_nodes, plain_cfg.as_dict()), run_id="p")
    drop = ("seconds",)  # wall times differ; every learned number must not
    assert [{k: v for k, v in m.items() if not any(d in k for d in drop)} for m in _rounds(warm)] == [
        {k: v for k, v in m.items() if not any(d in k for d in drop)} for m in _rounds(plain)
    ]
    # each worker served its node's four messages: the handshake, round 1's training, round 2's
    # (carrying round 1's evaluation), and round 2's evaluation
    for i in range(2):
        log = (tmp_path / f"worker-{i}.log").read_text()
        assert log.count("served ") == 4 and "(4 messages so far)" in log, log
    # the socket is the user's alone
    assert stat.S_IMODE(paths[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(paths[0].parent.stat().st_mode) == 0o700


def test_a_worker_serves_one_node_and_returns_a_handler_error_leaving_the_state(workers, make_cfg, pretrained_clip):
    (path,) = workers(1)
    cfg = make_cfg(method="promptfl")
    context = Context(1, 1000, {"partition-id": 0, "num-partitions": 2}, RecordDict(), cfg.as_dict())
    reply = forward(_message(MessageType.QUERY, 1000), context, str(path))
    assert reply is not None and not reply.has_error() and reply.content["metrics"]["num-train"] > 0
    other = Context(1, 1001, {"partition-id": 1, "num-partitions": 2}, RecordDict(), cfg.as_dict())
    with pytest.raises(WorkerError, match="serves node 1000, not node 1001"):
        forward(_message(MessageType.QUERY, 1001), other, str(path))
    bad_config = {**cfg.as_dict(), "method": "nope"}
    broken = Context(1, 1000, {"partition-id": 0, "num-partitions": 2}, RecordDict(), bad_config)
    broken.state["kept"] = ConfigRecord({"x": 1})
    with pytest.raises(WorkerError, match="nope"):
        forward(_message(MessageType.QUERY, 1000), broken, str(path))
    assert dict(broken.state["kept"]) == {"x": 1}
    # a ClientApp of other code (the app the node pinned is not what the worker runs) is refused
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        _send(sock, {"kind": "message", "code": "0" * 64}, _message(MessageType.QUERY, 1000), context)
        header, reply, _ = _receive(sock)
    assert header["kind"] == "error" and "other fedvlm code" in header["error"] and reply is None
    # garbage on the socket costs that connection only: the worker serves the next message
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        sock.sendall(b"FVW1" + (5).to_bytes(8, "big") + b"{nope" + bytes(16))
    assert not forward(_message(MessageType.QUERY, 1000), context, str(path)).has_error()


def test_no_worker_listening_means_the_message_runs_in_the_clientapp(tmp_path):
    context = Context(1, 1000, {}, RecordDict(), {})
    assert forward(_message(MessageType.QUERY, 1000), context, str(tmp_path / "none.sock")) is None


@pytest.mark.parametrize("behaviour", ["dies", "silent"])
def test_a_worker_lost_mid_message_is_a_lost_reply_not_a_hang(behaviour, tmp_path):
    """A stand-in worker that reads the message, then closes (dies) or never answers."""
    server = listen(tmp_path / "w" / "node.sock")

    def stand_in():
        conn, _ = server.accept()
        _receive(conn)
        if behaviour == "dies":
            conn.close()
        else:
            time.sleep(3)
            conn.close()

    threading.Thread(target=stand_in, daemon=True).start()
    context = Context(1, 1000, {}, RecordDict(), {"round-timeout": 0.5})
    t0 = time.time()
    with pytest.raises(WorkerError, match="lost mid-message"):
        forward(_message(MessageType.TRAIN, 1000), context, str(tmp_path / "w" / "node.sock"))
    assert time.time() - t0 < 2.5
    server.close()


def test_the_socket_folder_must_be_closed_to_others_and_one_worker_per_socket(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(PermissionError, match="chmod 700"):
        listen(shared / "node.sock")
    first = listen(tmp_path / "own" / "node.sock")
    with pytest.raises(OSError, match="already listens"):
        listen(tmp_path / "own" / "node.sock")
    first.close()
    listen(tmp_path / "own" / "node.sock").close()  # a dead worker's stale socket is replaced
