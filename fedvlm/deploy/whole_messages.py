"""A SuperNode's message and its objects in one request each way, its confirmations riding along.

With ``deploy.object_batches`` a SuperNode still makes five Fleet calls per message it handles:
``pull-messages`` (the message and its object tree), ``pull-objects`` (the contents),
``confirm-message-received``, then for its reply ``push-messages`` (which objects the SuperLink
lacks, and a push session) and ``push-objects``. Each pays TLS, the gateway, the node's signature
check and the SuperLink's HTTP stack. Two calls on the Fleet API carry the same requests together:

- ``pull-message``: ``PullMessageRequest {node, confirms}`` answered ``PulledMessage {pulled,
  objects}``: Flower's ``pull_messages`` answer (held as ``deploy.long_pulls`` holds a pull), then
  Flower's ``pull_object`` answer for the message's objects in the tree's order (Flower's
  ``iterate_object_tree``) until ``BATCH_BYTES`` of content. An object the ServerApp has not
  stored yet is waited for up to ``OBJECT_WAIT_S`` (it pushes the objects right after the
  message); what is still missing, or past the cap, the node pulls with ``pull-objects``.
- ``push-message``: ``PushMessageRequest {node, push, items, confirms}`` answered ``PushedMessage
  {pushed, objects}``: Flower's ``push_messages`` answer, then Flower's ``push_object`` answer for
  each item the SuperLink asked for, pushed in the session it opened (an item it did not ask for
  is answered ``stored: false`` and not stored). The request holds the objects that fit
  ``BATCH_BYTES`` beside the message itself (an error reply carries its reason in the message), so
  its body stays within the gateway's cap; the rest go by ``push-objects``.
- ``confirms``: the node's ``confirm-message-received`` requests, each answered by Flower's handler
  before the rest, sent with the node's next call instead of a call each. The SuperLink frees a
  received instruction's objects when its reply is pushed rather than when it is received.

Each part is handled by Flower's own handler, as the single calls are, in the order the node
would have made them, so what is stored, checked, counted and deleted is Flower's. The routes
enter Flower's table of protobuf routes (node authentication reads them as a single call) and a
request is refused whole (403, ``message_problem``) unless every part names the node that signed
it, no object or confirmation is named twice, and there are at most ``MAX_ITEMS`` items and
``MAX_CONFIRMS`` confirmations. The gateway holds each part to what it holds the single call to
(``fleet_gateway``): the push is checked as ``push-messages`` is, an item must be an object of the
pushed message's tree, and a confirmation must name a message the SuperLink sent that node.

The node's side (``Messages``): its connection's ``receive``, ``send`` and
``confirm_message_received``, handed on through Flower's own call sites in
``start_client_internal``. ``send`` keeps the reply and answers "every object, no session yet";
Flower's next step hands it the reply's objects (``object_batches.Link.push``), and they leave
together. The cost of not knowing beforehand which objects the SuperLink already holds: what fits
the first request travels even when it holds some (a node's reply holds what it trained;
nothing of it is on the SuperLink before). A SuperLink without the routes (403 or 404) gets
Flower's calls from then on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx

from fedvlm.deploy import flower_patches, long_pulls
from fedvlm.deploy.object_batches import (
    ABSENT,
    BATCH_BYTES,
    MAX_ITEMS,
    PREFIX,
    Batch,
    batch_problem,
    kinds,
    one_request,
    pushes,
)

log = logging.getLogger("fedvlm.deploy")

PULL, PUSH = "/pull-message", "/push-message"
MAX_CONFIRMS = 16  # confirmations per request (a node confirms one message per message it pulls)
OBJECT_WAIT_S = 2.0  # how long a pulled message's objects not stored yet are waited for
FIRST_WAIT_S, MOST_WAIT_S = 0.02, 0.2  # looks for them: doubling, at most this apart


def message_problem(request, pushed: bool) -> str | None:
    """Why a ``pull-message`` or ``push-message`` may not be served (None: it may): every part must
    name the node the request is signed as, each confirmation a message once, and the counts stay
    under their caps, so one request costs what its parts, each checked, would."""
    node, confirms = request.node.node_id, request.confirms
    if len(confirms) > MAX_CONFIRMS:
        return f"node {node} sent {len(confirms)} confirmations; at most {MAX_CONFIRMS}"
    if any(c.node.node_id != node for c in confirms):
        return f"node {node} sent a confirmation for another node"
    if len({c.message_object_id for c in confirms}) != len(confirms):
        return f"node {node} confirmed a message twice"
    if pushed and request.push.node.node_id != node:
        return f"node {node} pushed messages for node {request.push.node.node_id}"
    return batch_problem(request) if pushed else None


def _refuse(request, pushed: bool) -> None:
    from fastapi import HTTPException

    why = message_problem(request, pushed)
    if why is not None:
        raise HTTPException(status_code=403, detail=why)


# ---- the SuperLink -------------------------------------------------------------------------------
def _confirm(handlers, request, state) -> None:
    for confirm in request.confirms:
        handlers.confirm_message_received(request=confirm, state=state, store=state.object_store)


def _walk(ids: list[str], have: dict[str, Any], pull_one: Callable[[str], Any]) -> bool:
    """Pulls, in order, each of ``ids`` not in ``have`` until ``have`` holds ``BATCH_BYTES`` of
    content; True when none of those walked is still to come (not stored yet)."""
    size, complete = 0, True
    for object_id in ids:
        if size >= BATCH_BYTES:
            break
        if object_id not in have:
            answer = pull_one(object_id)
            if answer.object_found and not answer.object_available:
                complete = False
                continue
            have[object_id] = answer
        size += len(have[object_id].object_content)
    return complete


async def _objects(handlers, node, pulled, state) -> list:
    """Flower's answers for the pulled message's objects, in the tree's order, up to ``BATCH_BYTES``."""
    from flwr.proto.message_pb2 import PullObjectRequest, PullObjectResponse
    from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree
    from starlette.concurrency import run_in_threadpool

    if not pulled.messages_list:
        return []
    run_id = pulled.messages_list[0].metadata.run_id
    ids = [tree.object_id for tree in iterate_object_tree(pulled.message_object_trees[0])]

    def walk() -> bool:  # each walk its own request's state: the run's status read afresh
        with one_request(state) as items:
            return _walk(ids, have, lambda object_id: handlers.pull_object(request=ask(object_id), state=items))

    def ask(object_id: str):
        return PullObjectRequest(node=node, run_id=run_id, object_id=object_id)

    have: dict[str, Any] = {}
    loop, wait = asyncio.get_running_loop(), FIRST_WAIT_S
    deadline = loop.time() + OBJECT_WAIT_S
    while not await run_in_threadpool(walk) and loop.time() < deadline:
        await asyncio.sleep(wait)
        wait = min(2 * wait, MOST_WAIT_S)
    answers: list[Any] = []
    size = 0
    for object_id in ids:
        if answers and size >= BATCH_BYTES:
            break
        answers.append(have.get(object_id, PullObjectResponse(object_found=True, object_available=False)))
        size += len(answers[-1].object_content)
    return answers


def fleet_endpoints(handlers) -> dict[str, tuple[Callable, Any, Any]]:
    """The Fleet API's two routes: path -> (endpoint, request kind, answer kind)."""
    from flwr.proto.fleet_pb2 import PullMessagesRequest
    from flwr.proto.message_pb2 import PushObjectResponse
    from starlette.concurrency import run_in_threadpool

    async def fleet_pull_message(request, state):
        _refuse(request, pushed=False)
        await run_in_threadpool(_confirm, handlers, request, state)
        ask = PullMessagesRequest(node=request.node)
        pulled = await long_pulls.answer(
            lambda: handlers.pull_messages(request=ask, state=state, store=state.object_store),
            lambda answer: len(answer.messages_list) > 0,
        )
        objects = await _objects(handlers, request.node, pulled, state)
        return kinds()["PulledMessage"](pulled=pulled, objects=objects)

    def fleet_push_message(request, state):
        _refuse(request, pushed=True)
        with one_request(state) as items:
            _confirm(handlers, request, items)
            pushed = handlers.push_messages(request=request.push, state=items)
            wanted, stored = set(pushed.objects_to_push), []
            for item in request.items:
                item.session_id = pushed.session_id
            items.expect(pushes(item for item in request.items if item.object_id in wanted))
            for item in request.items:
                wants = item.object_id in wanted
                stored.append(handlers.push_object(request=item, state=items) if wants else PushObjectResponse())
        return kinds()["PushedMessage"](pushed=pushed, objects=stored)

    k = kinds()
    return {
        PULL: (fleet_pull_message, k["PullMessageRequest"], k["PulledMessage"]),
        PUSH: (fleet_push_message, k["PushMessageRequest"], k["PushedMessage"]),
    }


# ---- the SuperNode -------------------------------------------------------------------------------
def within(
    contents: Iterable[tuple[str, bytes]], budget: int
) -> tuple[list[tuple[str, bytes]], Iterator[tuple[str, bytes]]]:
    """The first of ``contents`` whose bytes fit ``budget`` (at most ``MAX_ITEMS`` of them), and
    the rest: a request stays within the gateway's cap even when its message is large itself (an
    error reply's reason travels in the message)."""
    items, size = iter(contents), 0
    first: list[tuple[str, bytes]] = []
    for item in items:
        if size + len(item[1]) > budget or len(first) == MAX_ITEMS:
            return first, itertools.chain([item], items)
        first.append(item)
        size += len(item[1])
    return first, iter(())


def _push_request(node, message, tree, runtime: float):
    """The ``PushMessagesRequest`` Flower's connection sends for a reply (its ``send``)."""
    from flwr.app.message import remove_content_from_message
    from flwr.common.serde import message_to_proto
    from flwr.proto.fleet_pb2 import PushMessagesRequest

    if message.has_content():
        message = remove_content_from_message(message)
    proto = message_to_proto(message)
    return PushMessagesRequest(
        node=node, messages_list=[proto], message_object_trees=[tree], clientapp_runtime_list=[runtime]
    )


class Messages:
    """A SuperNode connection's ``receive``, ``send`` and ``confirm_message_received`` through
    ``pull-message`` and ``push-message``; Flower's (``flower``: the three) where they are not served."""

    def __init__(self, link, flower: tuple[Callable, Callable, Callable]):
        self.link, self.served = link, True
        self.flower_receive, self.flower_send, self.flower_confirm = flower
        self.confirms: list = []  # confirmations not sent yet
        self.pending: tuple | None = None  # a reply (message, tree, runtime) waiting for its objects

    def call(self, path: str, request, answer):
        """The answer (None: the SuperLink has no such call, and Flower's calls are used from now on)."""
        if not self.served:
            return None
        try:
            return self.link.client._unary_unary(
                path=PREFIX + path, rpc_method=f"/fedvlm{PREFIX}{path}", request=request, response_type=answer
            )
        except httpx.HTTPStatusError as err:
            if err.response.status_code not in ABSENT:
                raise
            log.warning("%s%s answered HTTP %d: Flower's calls from now on", PREFIX, path, err.response.status_code)
            self.served = False
            return None

    def flush(self) -> None:
        """Confirmations not sent yet, each through Flower's call."""
        confirms, self.confirms = self.confirms, []
        for c in confirms:
            self.flower_confirm(c.run_id, c.message_object_id)

    def with_confirms(self, send: Callable[[list], Any]) -> Any:
        """``send(confirms)``; the confirmations kept for the next call if it fails, and sent by
        Flower's calls if it is not served."""
        confirms, self.confirms = self.confirms[:MAX_CONFIRMS], self.confirms[MAX_CONFIRMS:]
        try:
            answer = send(confirms)
        except BaseException:
            self.confirms[:0] = confirms
            raise
        if answer is None:
            self.confirms[:0] = confirms
            self.flush()
        return answer

    def receive(self):
        from flwr.common.serde import message_from_proto
        from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree

        ask, node = kinds()["PullMessageRequest"], self.link.node
        answer = self.with_confirms(lambda c: self.call(PULL, ask(node=node, confirms=c), kinds()["PulledMessage"]))
        if answer is None:
            return self.flower_receive()
        if not answer.pulled.messages_list:
            return None
        tree = answer.pulled.message_object_trees[0]
        ids = (t.object_id for t in iterate_object_tree(tree))
        self.link.ready = {i: a.object_content for i, a in zip(ids, answer.objects, strict=False) if a.object_available}
        return message_from_proto(answer.pulled.messages_list[0]), tree

    def send(self, message, tree, runtime: float) -> tuple[set[str], str]:
        """Keeps the reply for its objects (Flower hands them on next): every object, no session yet."""
        from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree

        if not self.served:
            return self.flower_send(message, tree, runtime)
        self.pending = (message, tree, runtime)
        return {t.object_id for t in iterate_object_tree(tree)}, ""

    def confirm(self, run_id: int, object_id: str) -> None:
        from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest

        if not self.served:
            return self.flower_confirm(run_id, object_id)
        confirm = ConfirmMessageReceivedRequest(node=self.link.node, run_id=run_id, message_object_id=object_id)
        self.confirms.append(confirm)
        return None

    def push(self, run_id: int, batch: Batch, push_one: Callable) -> None:
        """The kept reply with the first of its objects that fit ``BATCH_BYTES`` beside it; the rest
        the SuperLink asks for by ``push-objects`` in the session it opened."""
        from flwr.proto.message_pb2 import PushObjectRequest
        from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

        assert self.pending is not None  # Link.push hands a batch here only while a reply waits
        (message, tree, runtime), self.pending = self.pending, None
        push = _push_request(self.link.node, message, tree, runtime)
        first, later = within(batch.contents, BATCH_BYTES - push.ByteSize())  # the message counts against the cap
        items = [PushObjectRequest(node=self.link.node, run_id=run_id, object_id=i, object_content=c) for i, c in first]
        ask, node = kinds()["PushMessageRequest"], self.link.node
        answer = self.with_confirms(
            lambda c: self.call(PUSH, ask(node=node, push=push, items=items, confirms=c), kinds()["PushedMessage"])
        )
        if answer is None:  # Flower's push-messages, then the objects it asks for
            wanted, session = self.flower_send(message, tree, runtime)
            rest = ((i, c) for i, c in itertools.chain(first, later) if i in wanted)
            return self.link.push(run_id, session, Batch(contents=rest), push_one)
        wanted, session = set(answer.pushed.objects_to_push), answer.pushed.session_id
        if len(answer.objects) != len(first):
            raise ObjectPushError(first[0][0] if first else tree.object_id, run_id, session)
        for (object_id, _), stored in zip(first, answer.objects, strict=True):
            if object_id in wanted and not stored.stored:
                raise ObjectPushError(object_id, run_id, session)
        rest = ((i, c) for i, c in later if i in wanted)
        return self.link.push(run_id, session, Batch(contents=rest), push_one)


def connection(connect: Callable) -> Callable:
    """A SuperNode connection (``object_batches.batching``'s, which batches its objects) whose
    ``receive``, ``send`` and ``confirm_message_received`` go by ``Messages``; Flower's where the
    connection does not batch (a node that signs nothing)."""
    import contextlib

    from fedvlm.deploy import object_batches

    @contextlib.contextmanager
    def connected(*args, **kwargs):
        with connect(*args, **kwargs) as parts:
            link = object_batches.ACTIVE[-1] if object_batches.ACTIVE else None
            if link is None:
                yield parts
                return
            whole = link.whole = Messages(link, (parts[1], parts[2], parts[7]))
            try:
                yield (parts[0], whole.receive, whole.send, *parts[3:7], whole.confirm)
            finally:
                whole.flush()

    return connected


def check_flower(module) -> str | None:
    """The guard of ``whole-messages-served`` (the SuperLink's Fleet handlers) and
    ``whole-messages-sent`` (the SuperNode's calls to its connection)."""
    import inspect

    from fedvlm.deploy import object_batches

    if module.__name__ != "flwr.supernode.start_client_internal":
        why = object_batches.check_server()
        handlers = ("pull_messages", "push_messages", "confirm_message_received")
        return why or flower_patches.lacking(object_batches.server_parts()[1], *handlers)
    why = object_batches.check_supernode()
    needed = (
        "(recv := receive()) is None",
        "ids_obj_to_send, session_id = send(message, object_tree, clientapp_runtime)",
        "confirm_message_received(run_id, message.metadata.message_id)",
    )
    missing = next((n for n in needed if n not in inspect.getsource(module)), None)
    return why or (None if missing is None else f"its SuperNode no longer calls {missing}")


def serve() -> bool:
    """Serve ``pull-message`` and ``push-message`` on this SuperLink's Fleet API (before it builds
    its app); False, with a warning, where Flower's Fleet API is not the one this extends."""
    from fedvlm.deploy import flower_patches, object_batches

    if not flower_patches.applies("whole-messages-served"):
        return False
    fleet, handlers, _, translation = object_batches.server_parts()
    depends = {"state": fleet.LinkStateDependency}
    object_batches.route(fleet.router, PREFIX, fleet_endpoints(handlers), depends, translation.PROTOBUF_REQUEST_TYPES)
    return True


def install() -> bool:
    """This SuperNode's connection sends a message with its objects (after
    ``object_batches.install``, whose connection it extends); False, with a warning, where Flower's
    SuperNode does not read as this expects."""

    if not flower_patches.applies("whole-messages-sent"):
        return False
    from flwr.supernode import start_client_internal as sci

    sci.http_request_response = connection(sci.http_request_response)
    return True
