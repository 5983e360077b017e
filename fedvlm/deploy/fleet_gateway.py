"""The SuperLink's public face: the Fleet API that SuperNodes use, and nothing else, held to what
a SuperNode may send.

Flower serves three APIs on the SuperLink's one HTTPS port: the Fleet API (SuperNodes pull
messages and push replies), the Control API (``flwr run``, ``flwr ls``, ``flwr log``, ``flwr
supernode register``) and the ServerApp runtime. Open-source Flower authenticates no Control API
user, so the SuperLink listens on 127.0.0.1 only (``deploy.superlink`` admits only the
researcher's account there) and this gateway listens where SuperNodes can reach it. It terminates
TLS with the SuperLink's certificate and forwards ``POST /v1/fleet/<call>`` for the Fleet API's
calls (a fixed list: ``FLEET_CALLS``) to the SuperLink over TLS on loopback; everything else is
answered 403 and logged.

What it holds a request to:
- **A node pushes only its own replies, to the SuperLink.** Flower's SuperLink checks that a
  request is signed by the key of the node it names, not who the pushed message claims to be
  from: an organisation could push a message "from the SuperLink" to another organisation's node,
  which would act on it, or a reply in another node's name. ``check_push`` parses every
  ``push-messages`` body and refuses, with 403 and a log line, any message whose sender is not
  the node the request names (whose key the SuperLink then checks), whose destination is not the
  SuperLink, that answers no message, or whose id is not the hash of the Message object those
  very fields make (the SuperLink checks every object's hash when it arrives, so the object it
  stores carries the fields checked here). ``push-object`` must name its push session.
- **Who may send a body.** A request's SuperNode authentication (Flower's signed timestamp and
  the key it was signed with) is checked before a byte of its body is read, and with
  ``--node-keys`` (the registered SuperNodes' ``.pub`` files) the key must be one of them: a
  caller without a registered key reaches neither the body parser here nor the SuperLink's.
  ``--no-node-auth`` forwards unauthenticated requests, for a SuperLink that asks for none.
- **A node pulls only what it was sent.** ``pull-object`` is forwarded only for an object of a
  message the gateway saw the SuperLink send that node (``Sent``), and ``pull-objects`` only when
  every object it lists is one (``push-objects``: every item in a push session; both: every item
  for the node the request is signed as): knowing an object's id is not
  enough to read another organisation's replies, instructions or a run's model.
  ``confirm-message-received`` is forwarded only for a message sent to that node: the SuperLink
  deletes a confirmed message's objects, so another organisation's confirmation would take an
  instruction away before its node pulled it. ``pull-message`` and ``push-message``
  (``deploy.whole_messages``) are held part by part to the same: every confirmation one of the
  node's messages, the pushed reply checked as ``push-messages`` is, every pushed object one of
  that reply's tree; what a ``pull-message`` answer sent is learnt as a ``pull-messages`` one.
- **Size.** A body is at most ``--max-body`` bytes (default: Flower's largest array chunk, 5 MiB,
  plus 1 MiB for the rest of a request: the largest thing a real SuperNode sends is one chunk of
  one array), refused with 413 from its Content-Length or as soon as it grows past it; headers at
  most ``--max-header`` bytes (default 16 KiB; a SuperNode sends under 1 KiB).
- **Time.** A TLS handshake (started per connection once its address passed the connection
  limits) must finish within ``--handshake-timeout`` seconds, a request's
  headers within ``--header-timeout`` seconds of the connection (or of the previous response), its
  body within ``--body-timeout`` seconds of its headers; an idle keep-alive connection is closed
  after ``--keep-alive`` seconds. A client that sends a byte a second holds a connection for
  seconds, not forever.
- **Memory.** The bodies it holds at once (read, forwarded, awaiting the SuperLink's answer) are
  at most ``--max-inflight`` bytes in all and ``--max-inflight-per-peer`` from one address
  (defaults: 16 and 2 bodies at the cap); a request is counted at its declared size (or the cap)
  before a byte of its body is read, and one past either budget is answered 503 with
  ``Retry-After`` and logged, so concurrent bodies cannot grow the gateway or the SuperLink behind it.
- **Connections.** At most ``--max-connections`` open at once and ``--max-per-peer`` from one
  address, counted from the moment a connection is accepted (before its TLS handshake, which
  costs the gateway memory); past either, a new connection is closed at once (and logged, at
  most once a minute per address). A connection that has not finished its TLS handshake has sent
  nothing the gateway can check, so those are held apart: at most ``--max-handshakes-per-peer``
  from one address (past it, refused) and ``--max-handshakes`` in all, the oldest giving way to a
  new one, so silent TCP connections from many addresses cannot hold the slots honest clients need.
  The process's open-file limit is raised to its hard limit.
- **Who called.** Forwarding headers a client sends (``Forwarded``, ``X-Forwarded-*``,
  ``X-Real-IP``) are dropped and ``X-Forwarded-For`` is set to the caller's real address, so the
  SuperLink's log cannot be told another one; every forwarded call is logged with the real peer,
  the call, the status, the bytes and the time, to ``--log-file`` (rotated: ``--log-max-mb``,
  ``--log-backups``) or standard error.

    python -m fedvlm.deploy.fleet_gateway --listen 0.0.0.0:9092 --superlink 127.0.0.1:9093 \\
        --certfile server.crt --keyfile server.key --ca ca.crt --log-file gateway.log
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import logging
import logging.handlers
import resource
import ssl
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import h11
import httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("fedvlm.fleet_gateway")

# Flower 1.42's Fleet API (flwr/supernode/fleet_http_client.py): every call a SuperNode makes
FLEET_CALLS = frozenset(
    {
        "register-node",
        "activate-node",
        "deactivate-node",
        "unregister-node",
        "send-node-heartbeat",
        "pull-messages",
        "push-messages",
        "get-run",
        "get-fab",
        "push-object",
        "pull-object",
        "push-objects",  # a message's objects in one request (deploy.object_batches), checked item by item
        "pull-objects",
        "pull-message",  # a message with its objects, and confirmations (deploy.whole_messages), checked part by part
        "push-message",
        "confirm-message-received",
    }
)
FLEET_PREFIX = "/v1/fleet/"
# per-connection headers (RFC 9110, 7.6.1) and the ones the two hops set for themselves
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# what a caller may say about where a request came from: never believed, never passed on
FORWARDING_HEADERS = frozenset({"forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip"})
REFUSED = (
    "this address serves only the Fleet API that SuperNodes use; the Control API (flwr run, ls, log, supernode "
    "register) is reachable only on the SuperLink host (127.0.0.1) or through an SSH tunnel to it\n"
)
UPSTREAM_TIMEOUT = 600.0  # a SuperNode's call waits at most this for the SuperLink


def _chunk_limit() -> int:
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

    return int(FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE)


@dataclass(frozen=True)
class Limits:
    """What one caller may take of the gateway (the module docstring)."""

    max_body: int = 0  # bytes; 0: Flower's largest array chunk plus 1 MiB
    max_header: int = 16 * 1024
    handshake_timeout: float = 10.0
    header_timeout: float = 10.0
    body_timeout: float = 120.0
    keep_alive: int = 30
    max_connections: int = 1024
    max_per_peer: int = 64
    max_handshakes: int = 256  # connections whose TLS handshake is not done, in all (the oldest gives way)
    max_handshakes_per_peer: int = 8  # ... from one address (past it, refused)
    max_inflight: int = 0  # bytes of bodies held at once, in all; 0: 16 bodies at the cap
    max_inflight_per_peer: int = 0  # ... from one address; 0: 2 bodies at the cap

    @property
    def body(self) -> int:
        return self.max_body or _chunk_limit() + (1 << 20)

    @property
    def inflight(self) -> int:
        return self.max_inflight or 16 * self.body

    @property
    def inflight_per_peer(self) -> int:
        return self.max_inflight_per_peer or 2 * self.body


class InFlight:
    """The bytes of request bodies the gateway holds now (read, forwarded, awaiting the
    SuperLink), in all and by address. A request reserves its declared size (or the cap, when it
    declares none) before a byte of its body is read, and gives it back when its answer is sent:
    32 bodies just under the cap from one address once took the gateway from 79 to 622 MiB and
    the SuperLink, which parses a body before it authenticates it, from 174 to 450 MiB."""

    def __init__(self, limits: Limits):
        self.limits, self.total, self.by_peer = limits, 0, Counter[str]()

    def take(self, peer: str, size: int) -> bool:
        if self.total + size > self.limits.inflight or self.by_peer[peer] + size > self.limits.inflight_per_peer:
            return False
        self.total += size
        self.by_peer[peer] += size
        return True

    def give_back(self, peer: str, size: int) -> None:
        self.total -= size
        self.by_peer[peer] -= size
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]


def fleet_call(method: str, path: str) -> str | None:
    """The Fleet API call a request makes, or None if it is not one."""
    if method != "POST" or not path.startswith(FLEET_PREFIX):
        return None
    call = path[len(FLEET_PREFIX) :]
    return call if call in FLEET_CALLS else None


def _forwardable(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS | FORWARDING_HEADERS}


# ---- what a node may push ------------------------------------------------------------------------
def message_object_id(proto_message, children: Sequence[str]) -> str:
    """The id (SHA-256) of the Message object whose metadata and error are ``proto_message``'s and
    whose children are ``children``: what ``flwr.app.Message.deflate`` hashes
    (``check_message_ids`` holds it to the installed Flower)."""
    from flwr.proto.message_pb2 import Message as ProtoMessage
    from flwr.supercore.constant import HEAD_BODY_DIVIDER, HEAD_VALUE_DIVIDER

    metadata = type(proto_message.metadata)()
    metadata.CopyFrom(proto_message.metadata)
    metadata.message_id = ""
    body = ProtoMessage(
        metadata=metadata, content=None, error=proto_message.error if proto_message.HasField("error") else None
    ).SerializeToString(deterministic=True)
    head = f"Message{HEAD_VALUE_DIVIDER}{','.join(children)}{HEAD_VALUE_DIVIDER}{len(body)}".encode()
    return hashlib.sha256(head + HEAD_BODY_DIVIDER + body).hexdigest()


def check_message_ids() -> None:
    """``RuntimeError`` unless ``message_object_id`` gives the installed Flower's ids, for a
    reply with content and one with an error (the gateway then refuses to start)."""
    from flwr.app import ConfigRecord, Error, Message, RecordDict
    from flwr.common.serde import message_from_proto, message_to_proto, recorddict_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage
    from flwr.proto.message_pb2 import Metadata as ProtoMetadata
    from flwr.supercore.inflatable.inflatable_object import get_object_tree

    md = ProtoMetadata(run_id=5, src_node_id=1, dst_node_id=1234, group_id="1", created_at=1.0, ttl=60.0)
    md.message_type = "train"
    ask = message_from_proto(ProtoMessage(metadata=md, content=recorddict_to_proto(RecordDict())))
    ask.metadata.__dict__["_message_id"] = ask.object_id
    replies = (Message(RecordDict({"m": ConfigRecord({"x": 1})}), reply_to=ask), Message(Error(2, "x"), reply_to=ask))
    for reply in replies:
        tree = get_object_tree(reply)
        proto = message_to_proto(reply)
        if message_object_id(proto, [c.object_id for c in tree.children]) != tree.object_id:
            raise RuntimeError("this Flower hashes a Message differently from what the gateway checks")


def check_push(body: bytes) -> str | None:
    """Why a ``push-messages`` body must not reach the SuperLink (None: it may)."""
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from google.protobuf.message import DecodeError

    try:
        return push_problem(PushMessagesRequest.FromString(body))
    except DecodeError:
        return "not a PushMessagesRequest"


def push_problem(req) -> str | None:
    """Why a ``PushMessagesRequest`` must not reach the SuperLink (None: it may)."""
    from flwr.common.constant import SUPERLINK_NODE_ID

    if len(req.messages_list) != 1 or len(req.message_object_trees) != 1:
        return f"{len(req.messages_list)} messages and {len(req.message_object_trees)} trees, not one of each"
    node, md, tree = req.node.node_id, req.messages_list[0].metadata, req.message_object_trees[0]
    if md.src_node_id != node:
        return f"node {node} pushed a message from node {md.src_node_id}"
    if md.dst_node_id != SUPERLINK_NODE_ID:
        return f"node {node} pushed a message to node {md.dst_node_id}: a node may send only replies, to the SuperLink"
    if not md.reply_to_message_id:
        return f"node {node} pushed a message that answers no message"
    routed = message_object_id(req.messages_list[0], [c.object_id for c in tree.children])
    if not md.message_id == tree.object_id == routed:
        return f"node {node} pushed a message whose id is not the hash of its own fields"
    return None


def check_push_object(body: bytes) -> str | None:
    from flwr.proto.message_pb2 import PushObjectRequest
    from google.protobuf.message import DecodeError

    try:
        req = PushObjectRequest.FromString(body)
    except DecodeError:
        return "not a PushObjectRequest"
    return None if req.session_id else f"node {req.node.node_id} pushed an object outside a push session"


def _batch(body: bytes, pushed: bool):
    """A ``push-objects`` or ``pull-objects`` body parsed, with why it may not pass whole (or None)."""
    from google.protobuf.message import DecodeError

    from fedvlm.deploy.object_batches import batch_problem, requests

    try:
        req = requests()[pushed].FromString(body)
    except DecodeError:
        return None, f"not a {requests()[pushed].__name__}"
    return req, batch_problem(req)


def check_push_objects(body: bytes) -> str | None:
    """Each pushed object names its push session, and every item the node the request is signed as."""
    req, why = _batch(body, pushed=True)
    if why is None and not all(item.session_id for item in req.items):
        why = f"node {req.node.node_id} pushed an object outside a push session"
    return why


def tree_ids(tree) -> set[str]:
    """Every object id of a message's object tree."""
    ids, stack = set(), [tree]
    while stack:
        node = stack.pop()
        ids.add(node.object_id)
        stack.extend(node.children)
    return ids


def _whole(body: bytes, pushed: bool):
    """A ``pull-message`` or ``push-message`` body parsed, with why it may not pass whole (or None):
    each part as its single call is checked, an item an object of the pushed message."""
    from google.protobuf.message import DecodeError

    from fedvlm.deploy.object_batches import kinds
    from fedvlm.deploy.whole_messages import message_problem

    kind = kinds()["PushMessageRequest" if pushed else "PullMessageRequest"]
    try:
        req = kind.FromString(body)
    except DecodeError:
        return None, f"not a {kind.__name__}"
    why = message_problem(req, pushed)
    if why is None and pushed:
        why = push_problem(req.push)
    if why is None and pushed:
        tree = tree_ids(req.push.message_object_trees[0])
        stray = next((item.object_id for item in req.items if item.object_id not in tree), None)
        why = None if stray is None else f"node {req.node.node_id} pushed object {stray[:16]}... of another message"
    return req, why


CHECKS = {"push-messages": check_push, "push-object": check_push_object, "push-objects": check_push_objects}


def node_key(path: Path) -> bytes:
    """A SuperNode's registered public key (its ``.pub``, OpenSSH or PEM) as its requests carry it."""
    from cryptography.hazmat.primitives import serialization
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    data = Path(path).read_bytes()
    key = (
        serialization.load_pem_public_key(data)
        if data.startswith(b"-----")
        else serialization.load_ssh_public_key(data)
    )
    return public_key_to_bytes(key)  # type: ignore[arg-type]  # an EC key, as Flower's nodes use


def node_auth_refusal(headers, known: frozenset[bytes] | None) -> str | None:
    """Why a Fleet request's node-auth headers fail what the SuperLink will check (None: they
    pass): present, a signature by the key they carry over a timestamp within Flower's window,
    and, where the gateway was given the registered keys, one of those. Checked before a byte of
    the body is read; the SuperLink still checks the node id the key is registered under."""
    import binascii
    import datetime
    from base64 import b64decode

    from flwr.common.constant import SYSTEM_TIME_TOLERANCE, TIMESTAMP_HEADER, TIMESTAMP_TOLERANCE
    from flwr.supercore.constant import FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER
    from flwr.supercore.primitives.asymmetric import bytes_to_public_key, verify_signature

    try:
        public = b64decode(headers[FLEET_HTTP_PUBLIC_KEY_HEADER], validate=True)
        signature = b64decode(headers[FLEET_HTTP_SIGNATURE_HEADER], validate=True)
        stamp = headers[TIMESTAMP_HEADER]
        age = (datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(stamp)).total_seconds()
        if not -SYSTEM_TIME_TOLERANCE < age < TIMESTAMP_TOLERANCE + SYSTEM_TIME_TOLERANCE:
            return f"its signed timestamp is {age:.0f} s old"
        if not verify_signature(bytes_to_public_key(public), stamp.encode("ascii"), signature):
            return "its signature does not verify"
    except KeyError:
        return "it carries no SuperNode authentication"
    except (ValueError, TypeError, UnicodeError, binascii.Error) as err:
        return f"its SuperNode authentication cannot be read ({type(err).__name__})"
    if known is not None and public not in known:
        return UNREGISTERED
    return None


UNREGISTERED = "its key is not one of the registered SuperNodes'"


def auth_refusal(why: str) -> Response:
    """A request refused for its SuperNode authentication, answered as the SuperLink answers the
    same: a key nobody registered as Flower's failed activation (412 and Flower's error, whose
    details name the fix: Flower's SuperNode prints them and exits 1); a missing or bad signature,
    or a stale timestamp, 401 (on which Flower's SuperNode stops itself, as it does for the
    SuperLink's own 401). A 401 for an unregistered key made the SuperNode exit 0, saying only
    that it 'terminated gracefully'."""
    from flwr.supercore.error import ApiErrorCode, FlowerError
    from flwr.supercore.error.catalog import API_ERROR_MAP

    close = {"connection": "close"}
    if why != UNREGISTERED:
        return PlainTextResponse(f"refused: {why}\n", status_code=401, headers=close)
    details = (
        f"the Fleet gateway refused it: {why}. Register its public key (flwr supernode register <key>.pub "
        "<federation>) and give the gateway that .pub among --node-keys (restart it)"
    )
    err = FlowerError(ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED, why, public_details=details)
    spec = API_ERROR_MAP[err.code]
    return JSONResponse(err.to_json(spec.public_message), status_code=spec.http_status_code, headers=close)


class Sent:
    """The objects the SuperLink sent each node, learnt from the ``pull-messages`` answers the
    gateway forwarded (each message's whole object tree): a node may ``pull-object`` only those.
    Without this, an object's id was all it took: with ids read from the SuperLink's database one
    organisation pulled another's handshake reply, its instructions and a run's final model after
    it was excluded from that run. At most ``per_node`` ids are kept per node, the oldest dropped."""

    def __init__(self, per_node: int = 1 << 16):
        self.per_node = per_node
        self.by_node: dict[int, dict[str, None]] = {}  # node id -> object ids, oldest first

    def learn(self, call: str, request_body: bytes, answer: bytes) -> None:
        """What a ``pull-messages`` or ``pull-message`` answer sent the node."""
        from flwr.proto.fleet_pb2 import PullMessagesRequest, PullMessagesResponse
        from google.protobuf.message import DecodeError

        from fedvlm.deploy.object_batches import kinds

        try:
            if call == "pull-message":
                node = kinds()["PullMessageRequest"].FromString(request_body).node.node_id
                pulled = kinds()["PulledMessage"].FromString(answer).pulled
            else:
                node = PullMessagesRequest.FromString(request_body).node.node_id
                pulled = PullMessagesResponse.FromString(answer)
        except DecodeError:
            return
        stack = list(pulled.message_object_trees)
        if not stack:  # an idle node's poll: nothing to learn, nothing to copy
            return
        ids = self.by_node.setdefault(node, {})
        while stack:
            tree = stack.pop()
            ids.pop(tree.object_id, None)
            ids[tree.object_id] = None  # newest last
            stack.extend(tree.children)
        while len(ids) > self.per_node:  # the oldest first, without copying the rest
            del ids[next(iter(ids))]

    def check(self, body: bytes) -> str | None:
        """A node pulls only an object sent to it."""
        return self._sent_to(body, "PullObjectRequest", "object_id")

    def check_batch(self, body: bytes) -> str | None:
        req, why = _batch(body, pushed=False)
        return why or self.unsent(req.node.node_id, [item.object_id for item in req.items])

    def check_confirm(self, body: bytes) -> str | None:
        """A node confirms only a message sent to it (a confirmation deletes the message's objects)."""
        return self._sent_to(body, "ConfirmMessageReceivedRequest", "message_object_id")

    def _sent_to(self, body: bytes, kind: str, field: str) -> str | None:
        """Why a ``kind`` request (of Flower's message.proto) names, in ``field``, what was not sent
        to its node (None: it was)."""
        from flwr.proto import message_pb2
        from google.protobuf.message import DecodeError

        try:
            req = getattr(message_pb2, kind).FromString(body)
        except DecodeError:
            return f"not a {kind}"
        return self.unsent(req.node.node_id, [getattr(req, field)])

    def check_whole(self, body: bytes, pushed: bool) -> str | None:
        req, why = _whole(body, pushed)
        return why or self.unsent(req.node.node_id, [c.message_object_id for c in req.confirms])

    def checks(self) -> dict[str, Callable[[bytes], str | None]]:
        """The calls whose checks read what was sent, with the rest (``CHECKS``)."""
        return {
            **CHECKS,
            "pull-object": self.check,
            "pull-objects": self.check_batch,
            "confirm-message-received": self.check_confirm,
            "pull-message": functools.partial(self.check_whole, pushed=False),
            "push-message": functools.partial(self.check_whole, pushed=True),
        }

    def unsent(self, node: int, object_ids: list[str]) -> str | None:
        known = self.by_node.get(node, {})
        for object_id in object_ids:
            if object_id not in known:
                return f"node {node} asked for object {object_id[:16]}..., which was not sent to it"
        return None


# ---- the app -------------------------------------------------------------------------------------
class TooLarge(Exception):
    pass


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise TooLarge(declared)
    out = bytearray()
    async for chunk in request.stream():
        out += chunk
        if len(out) > limit:
            raise TooLarge(len(out))
    return bytes(out)


class Gateway:
    """One gateway: its SuperLink client, the request bodies it holds, the objects it forwarded."""

    def __init__(
        self,
        superlink: str,
        ca: str,
        limits: Limits,
        transport: httpx.AsyncBaseTransport | None,
        node_auth: bool,
        node_keys: frozenset[bytes] | None,
    ):
        check_message_ids()
        self.superlink, self.limits, self.node_auth, self.node_keys = superlink, limits, node_auth, node_keys
        self.client = httpx.AsyncClient(
            base_url=f"https://{superlink}",
            verify=ssl.create_default_context(cafile=ca) if transport is None else True,
            timeout=UPSTREAM_TIMEOUT,
            transport=transport,
        )
        self.held, self.sent = InFlight(limits), Sent()
        self.checks = self.sent.checks()

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            yield
            await self.client.aclose()

        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
        return Starlette(routes=[Route("/{path:path}", self.forward, methods=methods)], lifespan=lifespan)

    def refusal(self, request: Request, call: str | None, peer: str) -> Response | None:
        """The answer to a request refused from its headers alone (None: it passes), cheapest first."""
        if call is None:
            log.warning("refused %s %s from %s", request.method, request.url.path[:200], peer)
            return PlainTextResponse(REFUSED, status_code=403)
        # h11 bounds headers still arriving (max_header); these arrived whole, in one read
        header_bytes, most = sum(len(k) + len(v) + 4 for k, v in request.headers.raw), self.limits.max_header
        if header_bytes > most:
            log.warning("refused %s from %s: %d bytes of headers, over %d", call, peer, header_bytes, most)
            text = f"request headers may be at most {most} bytes\n"
            return PlainTextResponse(text, status_code=431, headers={"connection": "close"})
        why = node_auth_refusal(request.headers, self.node_keys) if self.node_auth else None
        if why is not None:
            log.warning("refused %s from %s before its body: %s", call, peer, why)
            return auth_refusal(why)
        return None

    async def forward(self, request: Request) -> Response:
        """A request refused from its headers if it can be, before its body is read; else its body
        held within the in-flight budget while it is checked and forwarded."""
        t0 = time.monotonic()
        call = fleet_call(request.method, request.url.path)
        peer = request.client.host if request.client else "?"
        refused = self.refusal(request, call, peer)
        if refused is not None:
            return refused
        assert call is not None  # refusal() answers a call the Fleet API does not have
        declared, limits = request.headers.get("content-length", ""), self.limits
        size = int(declared) if declared.isdigit() and int(declared) <= limits.body else limits.body
        if not self.held.take(peer, size):
            log.warning(
                "refused a request from %s for now: %d bytes of bodies held in all, %d from it (limits %d, %d)",
                peer,
                self.held.total,
                self.held.by_peer[peer],
                limits.inflight,
                limits.inflight_per_peer,
            )
            return PlainTextResponse(
                "the gateway holds as many request bodies as it may: retry shortly\n",
                status_code=503,
                headers={"retry-after": "1", "connection": "close"},
            )
        try:
            return await self._forward(request, call, peer, t0)
        finally:
            self.held.give_back(peer, size)

    async def _forward(self, request: Request, call: str, peer: str, t0: float) -> Response:
        """The body read within its cap and checked, then sent on to the SuperLink."""
        try:
            body = await _body(request, self.limits.body)
        except TooLarge as size:
            log.warning("refused %s from %s: a body of %s bytes, over %d", call, peer, size, self.limits.body)
            text = f"a request body may be at most {self.limits.body} bytes\n"
            return PlainTextResponse(text, status_code=413, headers={"connection": "close"})
        except ClientDisconnect:
            return Response(status_code=400)
        check = self.checks.get(call)
        why = check(body) if check is not None else None
        if why is not None:
            log.warning("refused %s from %s: %s", call, peer, why)
            return PlainTextResponse(f"refused: {why}\n", status_code=403)
        return await self._upstream(request, call, peer, body, t0)

    async def _upstream(self, request: Request, call: str, peer: str, body: bytes, t0: float) -> Response:
        headers = {**_forwardable(request.headers), "x-forwarded-for": peer}
        try:
            upstream = await self.client.post(FLEET_PREFIX + call, content=body, headers=headers)
        except httpx.HTTPError as err:
            log.error("the SuperLink at %s did not answer %s from %s: %s", self.superlink, call, peer, err)
            return PlainTextResponse(f"the SuperLink did not answer: {type(err).__name__}\n", status_code=502)
        status, took = upstream.status_code, 1000 * (time.monotonic() - t0)
        log.info("%s %s %d in %d out %d %.0f ms", peer, call, status, len(body), len(upstream.content), took)
        if call in ("pull-messages", "pull-message") and status == 200:  # what this node may now pull
            self.sent.learn(call, body, upstream.content)
        return Response(upstream.content, status_code=status, headers=_forwardable(upstream.headers))


def make_app(
    superlink: str,
    ca: str,
    limits: Limits = Limits(),
    transport: httpx.AsyncBaseTransport | None = None,
    node_auth: bool = False,
    node_keys: frozenset[bytes] | None = None,
) -> Starlette:
    """The gateway for the SuperLink at ``superlink`` (host:port on this machine), whose
    certificate ``ca`` verifies (``transport``: another way to reach it, for tests). With
    ``node_auth`` a request's SuperNode authentication is checked before its body is read
    (``node_auth_refusal``; against ``node_keys`` where given)."""
    return Gateway(superlink, ca, limits, transport, node_auth, node_keys).app()


# ---- the server: connections and their time ------------------------------------------------------
class Connections:
    """The connection books every connection's protocol shares: open connections by address, and
    connections before their TLS handshake is done (they have sent nothing the gateway can check):
    a few per address, and in all a pool whose oldest gives way to a new one, so silent TCP
    connections from many addresses cannot keep the gateway's slots from honest clients."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.open_by_peer: Counter[str] = Counter()
        self.warned: dict[str, float] = {}
        self.shaking: dict[asyncio.Transport, str] = {}  # the raw transport -> its address, oldest first
        self.shaking_by_peer: Counter[str] = Counter()

    def warn(self, peer: str, text: str, *args) -> None:
        """A warning about ``peer``, at most once a minute per address."""
        now = time.monotonic()
        if now - self.warned.get(peer, -1e9) > 60:
            self.warned[peer] = now
            log.warning(text, *args)

    def admit(self, peer: str) -> bool:
        """Whether a new connection from ``peer`` is within the connection limits (counted if so)."""
        total, limits = sum(self.open_by_peer.values()), self.limits
        if total < limits.max_connections and self.open_by_peer[peer] < limits.max_per_peer:
            self.open_by_peer[peer] += 1
            return True
        self.warn(
            peer,
            "refused connections from %s: %d open from it, %d in all (limits %d, %d)",
            peer,
            self.open_by_peer[peer],
            total,
            limits.max_per_peer,
            limits.max_connections,
        )
        return False

    def release(self, peer: str) -> None:
        self.open_by_peer[peer] -= 1
        if self.open_by_peer[peer] <= 0:
            del self.open_by_peer[peer]

    def shake(self, raw: asyncio.Transport, peer: str) -> bool:
        """Whether ``peer``'s connection may start its TLS handshake (counted as pending if so);
        a full pool closes its oldest pending handshake to make room."""
        if self.shaking_by_peer[peer] >= self.limits.max_handshakes_per_peer:
            self.warn(
                peer,
                "refused a connection from %s: %d TLS handshakes pending from it",
                peer,
                self.limits.max_handshakes_per_peer,
            )
            return False
        if len(self.shaking) >= self.limits.max_handshakes:
            oldest, whose = next(iter(self.shaking.items()))
            self.warn(
                whose, "closed the oldest pending TLS handshake (from %s): %d pending in all", whose, len(self.shaking)
            )
            self.shaken(oldest)
            oldest.abort()
        self.shaking[raw] = peer
        self.shaking_by_peer[peer] += 1
        return True

    def shaken(self, raw: asyncio.Transport) -> None:
        """A pending handshake ended (done, failed or given way)."""
        peer = self.shaking.pop(raw, None)
        if peer is not None:
            self.shaking_by_peer[peer] -= 1
            if self.shaking_by_peer[peer] <= 0:
                del self.shaking_by_peer[peer]


class Guarded(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the connection and time limits (the module docstring).
    The server listens on plain TCP and each connection starts its TLS here (``tls``), after its
    address passed the connection limits: a client that never finishes its handshake holds one
    counted connection for ``handshake_timeout`` seconds, no more. ``guarded_protocol`` makes the
    class a server uses, with its limits, TLS context and books."""

    limits: Limits
    tls: ssl.SSLContext | None
    books: Connections
    _deadline: asyncio.TimerHandle | None = None
    _peer = ""
    _cycle_seen: object = None
    _early: list[bytes] = []  # replaced, never appended to in place
    _hint = 0  # the status h11 suggested for the request it could not parse (0: none)

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, what: str) -> None:
        log.warning("closed a connection from %s: %s took longer than allowed", self._peer, what)
        self.transport.abort()

    def _release(self) -> None:
        if self._peer:
            self.books.release(self._peer)
            self._peer = ""

    def connection_made(self, transport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if peername else "?"
        if not self.books.admit(peer):
            transport.abort()
            return
        self._peer = peer
        if self.tls is None:
            self._serve(transport)
            return
        if not self.books.shake(transport, peer):
            transport.abort()
            self._release()
            return
        transport.pause_reading()  # nothing is read until the TLS layer is in place to read it
        self.loop.create_task(self._start_tls(transport))

    async def _start_tls(self, raw) -> None:
        try:
            secured = await self._handshake(raw)
        finally:
            self.books.shaken(raw)
        if secured is not None:
            self._serve(secured)

    async def _handshake(self, raw):
        """The TLS transport over ``raw``, or None (the connection closed and released)."""
        assert self.tls is not None  # connection_made starts TLS only with a context
        try:
            secured = await self.loop.start_tls(
                raw, self, self.tls, server_side=True, ssl_handshake_timeout=self.limits.handshake_timeout
            )
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError, RuntimeError):
            raw.abort()
            self._release()
            return None
        if secured is None:  # the connection went away during the handshake
            self._release()
        return secured

    def _serve(self, transport) -> None:
        super().connection_made(transport)
        self._hint = 0
        receive = self.conn.next_event

        def next_event():  # keeps the status h11 suggests for a request it cannot parse
            try:
                return receive()
            except h11.RemoteProtocolError as err:
                self._hint = err.error_status_hint
                raise

        self.conn.next_event = next_event  # type: ignore[method-assign]
        self._arm(self.limits.header_timeout, "the request's headers")
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            # the TLS layer may hand over a request's first bytes before start_tls returns
            self._early = [*self._early, data]
            return
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and cycle is not self._cycle_seen:  # a new request's headers are in
            self._cycle_seen = cycle
            self._arm(self.limits.body_timeout, "the request's body")
        if cycle is not None and not cycle.more_body:  # its body is in: the app's turn
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers every request h11 cannot parse with 400; headers still arriving
        past ``max_header`` get the documented 431, and every such refusal a log line."""
        if self._hint != 431:
            log.warning("refused a request from %s that is not HTTP/1.1 h11 can parse", self._peer)
            return super().send_400_response(msg)
        most = self.limits.max_header
        log.warning("refused a request from %s: its headers ran past %d bytes", self._peer, most)
        event = h11.Response(
            status_code=431, headers=[(b"connection", b"close")], reason=b"Request Header Fields Too Large"
        )
        self.transport.write(self.conn.send(event))
        self.transport.write(self.conn.send(h11.Data(data=f"request headers may be at most {most} bytes\n".encode())))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.limits.header_timeout + self.limits.keep_alive, "the next request's headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        if self.transport is not None:  # served: uvicorn's own bookkeeping
            super().connection_lost(exc)


def guarded_protocol(limits: Limits, tls: ssl.SSLContext | None) -> type[Guarded]:
    """The protocol class one gateway server uses: ``Guarded`` with its limits, TLS context and books."""
    return type("Guarded", (Guarded,), {"limits": limits, "tls": tls, "books": Connections(limits)})


def raise_open_files() -> int:
    """The soft limit on open files raised to the hard one (each connection holds one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def serve(app: Starlette, host: str, port: int, limits: Limits, certfile: str | None, keyfile: str | None) -> None:
    """Serve ``app`` with ``limits`` (TLS with ``certfile``/``keyfile``, started per connection)."""
    import uvicorn

    tls = None
    if certfile:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(certfile, keyfile)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits, tls),
        loop="asyncio",  # its start_tls hands a connection over to TLS as documented (uvloop's did not, here)
        h11_max_incomplete_event_size=limits.max_header,
        timeout_keep_alive=limits.keep_alive,
        proxy_headers=False,  # a caller's X-Forwarded-For is never believed
        server_header=False,
        access_log=False,  # every call is logged by the app, with its real peer
        log_level="warning",
        backlog=limits.max_connections,
    )
    uvicorn.Server(config).run()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _logging(path: str | None, max_mb: float, backups: int) -> None:
    handler: logging.Handler = (
        logging.handlers.RotatingFileHandler(path, maxBytes=int(max_mb * 2**20), backupCount=backups)
        if path
        else logging.StreamHandler()
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # httpx logs each upstream request at INFO: every forwarded call was logged twice
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.fleet_gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=_host_port, required=True, help="HOST:PORT SuperNodes connect to")
    p.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink on this machine (127.0.0.1:...)")
    p.add_argument("--certfile", required=True, help="the SuperLink's certificate (server.crt)")
    p.add_argument("--keyfile", required=True, help="its private key (server.key)")
    p.add_argument("--ca", required=True, help="the CA certificate that verifies the SuperLink (ca.crt)")
    d = Limits()
    p.add_argument("--max-body", type=int, default=d.max_body, help="bytes (0: Flower's array chunk + 1 MiB)")
    p.add_argument("--max-header", type=int, default=d.max_header, help="bytes of a request's headers")
    p.add_argument("--handshake-timeout", type=float, default=d.handshake_timeout, help="seconds for TLS")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout, help="seconds for a request's headers")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout, help="seconds for a request's body")
    p.add_argument("--keep-alive", type=int, default=d.keep_alive, help="seconds an idle connection stays open")
    p.add_argument("--max-connections", type=int, default=d.max_connections, help="open connections in all")
    p.add_argument("--max-per-peer", type=int, default=d.max_per_peer, help="open connections from one address")
    p.add_argument("--max-handshakes", type=int, default=d.max_handshakes, help="pending TLS handshakes in all")
    p.add_argument(
        "--max-handshakes-per-peer", type=int, default=d.max_handshakes_per_peer, help="... from one address"
    )
    p.add_argument("--max-inflight", type=int, default=d.max_inflight, help="bytes of bodies held at once (0: 16 caps)")
    p.add_argument(
        "--max-inflight-per-peer", type=int, default=d.max_inflight_per_peer, help="... from one address (0: 2 caps)"
    )
    p.add_argument(
        "--node-keys",
        nargs="*",
        type=Path,
        default=None,
        help="the registered SuperNodes' public keys (.pub): one signed by another key is refused before its body",
    )
    p.add_argument(
        "--no-node-auth",
        action="store_true",
        help="forward requests without SuperNode authentication (only for a SuperLink that does not ask for it)",
    )
    p.add_argument("--log-file", help="log here, rotated (default: standard error)")
    p.add_argument("--log-max-mb", type=float, default=20.0, help="size at which the log file is rotated")
    p.add_argument("--log-backups", type=int, default=5, help="rotated log files kept")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    limits = Limits(
        args.max_body,
        args.max_header,
        args.handshake_timeout,
        args.header_timeout,
        args.body_timeout,
        args.keep_alive,
        args.max_connections,
        args.max_per_peer,
        args.max_handshakes,
        args.max_handshakes_per_peer,
        args.max_inflight,
        args.max_inflight_per_peer,
    )
    _logging(args.log_file, args.log_max_mb, args.log_backups)
    host, port = args.listen
    files = raise_open_files()
    log.info(
        "forwarding the Fleet API from %s:%d to %s (every other request refused): %s, %d open files",
        host,
        port,
        args.superlink,
        limits,
        files,
    )
    try:
        keys = None if args.node_keys is None else frozenset(node_key(k) for k in args.node_keys)
    except (OSError, ValueError) as err:
        p.error(f"--node-keys: {err}")
    app = make_app(args.superlink, args.ca, limits, node_auth=not args.no_node_auth, node_keys=keys)
    serve(app, host, port, limits, args.certfile, args.keyfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
