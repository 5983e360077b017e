"""A node's warm worker: one long-lived process beside a SuperNode (same host, same user) that
runs the node's messages, so that the model, the data and the image features stay loaded
between them.

Flower starts a fresh ``flwr-clientapp`` process for every message; on its own that process
imports torch and the project and loads the backbone and the data again each time
(``bench/message_cost.py`` measures what that costs). When the node config names a worker
(``node-worker='<socket path>'``), the ClientApp (``client_app.app``) imports only Flower, sends
the message and its ``Context`` to the worker over a Unix socket, and returns the worker's
reply and updated ``Context``. With no worker listening there it runs the message itself, as
without one.

What this keeps:
- Private state: the worker holds none between messages. The node's private state travels in
  the ``Context`` Flower keeps for the node, exactly as in-process; the worker persists it to
  the node's ``state-dir`` after every round with the same code (``client_app.handlers``), so a
  resume is unchanged. What stays warm is the node's own data, its features and the frozen
  backbone, none of which leaves the node.
- Who can reach it: the socket lives in a directory only the node's user can enter (0700), is
  itself 0600, and the worker checks each caller's uid (``SO_PEERCRED``). It serves one node:
  the first message binds it to that node id, and a message of another node is refused.
- The app the node pinned: the message runs in the worker's copy of the project, so the worker
  refuses a ClientApp whose project source differs from its own (``code_digest``: every file
  of the package). A node runs the app it agreed to even when the worker was started from an
  older checkout; restarting the worker from the pinned version is the fix it names.
- DP fails closed exactly as in-process: the same handlers run, on the same messages.
- Failure is a lost reply, never a hang: a worker that dies mid-message closes the socket, and
  the ClientApp raises (Flower sends the server an error reply); a worker that does not answer
  within the run's round-timeout is abandoned the same way. An exception in a handler comes
  back as the same exception's text and leaves the node's ``Context`` as it was, as Flower does
  in-process.

Frames: 4 bytes ``FVW1``, then three parts, each an 8-byte big-endian length and its bytes: a
JSON header, the ``Message`` protobuf, the ``Context`` protobuf. A reply has the same layout
(its header says whether it is a reply or an error).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage

log = logging.getLogger(__name__)

MAGIC = b"FVW1"
CONNECT_TIMEOUT = 5.0  # seconds to reach a listening worker


class WorkerError(RuntimeError):
    """The worker refused the message, failed on it, or was lost mid-message."""


_DIGEST: list[str] = []


def code_digest() -> str:
    """sha256 of the project's Python source as this process imports it (paths and bytes)."""
    if not _DIGEST:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


# ---- frames ------------------------------------------------------------------------------------
def _send(sock: socket.socket, header: dict, message: Message | None, context: Context | None) -> None:
    parts = [
        json.dumps(header).encode(),
        message_to_proto(message).SerializeToString() if message is not None else b"",
        context_to_proto(context).SerializeToString() if context is not None else b"",
    ]
    sock.sendall(MAGIC + b"".join(struct.pack(">Q", len(p)) + p for p in parts))


def _read(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the other side closed the connection mid-frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket) -> tuple[dict, Message | None, Context | None]:
    if _read(sock, 4) != MAGIC:
        raise ConnectionError("not a node-worker frame")
    parts = [_read(sock, struct.unpack(">Q", _read(sock, 8))[0]) for _ in range(3)]
    message = context = None
    if parts[1]:
        proto = ProtoMessage()
        proto.ParseFromString(parts[1])
        message = message_from_proto(proto)
    if parts[2]:
        proto_ctx = ProtoContext()
        proto_ctx.ParseFromString(parts[2])
        context = context_from_proto(proto_ctx)
    return json.loads(parts[0]), message, context


# ---- the ClientApp's side ----------------------------------------------------------------------
def forward(msg: Message, context: Context, path: str) -> Message | None:
    """Run ``msg`` on the worker at ``path``: its reply, with ``context`` updated in place; None
    when no worker listens there (the caller runs the message itself)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            log.warning("no node worker listens on %s: this message runs in the ClientApp's own process", path)
            return None
        sock.settimeout(float(context.run_config.get("round-timeout", 600.0)))
        try:
            _send(sock, {"kind": "message", "code": code_digest()}, msg, context)
            header, reply, updated = _receive(sock)
        except (ConnectionError, TimeoutError, OSError) as err:
            raise WorkerError(
                f"the node worker at {path} was lost mid-message ({type(err).__name__}: {err}); "
                "this reply is lost, the next message starts afresh"
            ) from err
    finally:
        sock.close()
    if header.get("kind") != "reply" or reply is None or updated is None:
        raise WorkerError(str(header.get("error") or "the node worker sent no reply"))
    context.state = updated.state
    return reply


# ---- the worker's side -------------------------------------------------------------------------
def listen(path: Path) -> socket.socket:
    """A socket at ``path`` that only this user can reach (module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.parent.stat().st_uid != os.getuid() or path.parent.stat().st_mode & 0o077:
        raise PermissionError(
            f"{path.parent} must belong to this user and be closed to others (chmod 700): the node "
            "worker's socket lives there"
        )
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise OSError(f"a node worker already listens on {path}: stop it first (one worker per node)")
        except ConnectionRefusedError:
            path.unlink()  # a stale socket of a worker that died
        finally:
            probe.close()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    server.listen(8)
    return server


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class Worker:
    """Serves one node's messages, one at a time, with the in-process handlers."""

    def __init__(self):
        self.node_id: int | None = None  # bound by the first message
        self.served = 0
        code_digest()  # the source as it is now, when the worker imports it

    def refusal(self, header: dict, context: Context) -> str:
        if header.get("code") != code_digest():
            return (
                "this node worker runs other fedvlm code than the ClientApp the SuperNode runs (source "
                f"{str(header.get('code'))[:12]} there, {code_digest()[:12]} here): restart the worker from the "
                "app version the node pinned"
            )
        if self.node_id is not None and context.node_id != self.node_id:
            return (
                f"this node worker serves node {self.node_id}, not node {context.node_id}: start one worker "
                "per SuperNode, each with its own socket"
            )
        return ""

    def serve_one(self, conn: socket.socket) -> None:
        if _peer_uid(conn) != os.getuid():
            return  # not this user: the socket's mode already keeps others out
        header, msg, context = _receive(conn)
        if header.get("kind") != "message" or msg is None or context is None:
            _send(conn, {"kind": "error", "error": "the node worker expected a message and its context"}, None, None)
            return
        why = self.refusal(header, context)
        if why:
            _send(conn, {"kind": "error", "error": why}, None, None)
            return
        self.node_id = context.node_id
        from fedvlm.client_app.handlers import handle
        from fedvlm.client_app.layers import layered

        t0 = time.perf_counter()
        try:
            reply = layered(handle)(msg, context)
        except Exception as err:  # noqa: BLE001 - as Flower does in-process: the error goes back, state untouched
            _send(conn, {"kind": "error", "error": f"{type(err).__name__}: {err}"}, None, None)
            return
        self.served += 1
        _send(conn, {"kind": "reply"}, reply, context)
        log.info(
            "served %s of run %d for node %d in %.2f s (%d messages so far)",
            msg.metadata.message_type,
            context.run_id,
            context.node_id,
            time.perf_counter() - t0,
            self.served,
        )

    def run(self, server: socket.socket) -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                try:
                    self.serve_one(conn)
                except (ConnectionError, OSError) as err:  # the ClientApp went away: wait for the next
                    log.warning("a ClientApp left mid-message: %s", err)
                except Exception as err:  # noqa: BLE001 - a malformed frame must not end the worker
                    log.warning("dropped a connection that sent no valid frame: %s: %s", type(err).__name__, err)
