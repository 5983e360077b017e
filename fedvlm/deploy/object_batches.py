"""A message's objects in one request instead of one request each.

Flower 1.42 moves a message as a tree of objects (the message, its record dict, each record, each
array chunk), and whoever sends or receives it makes one call per object (``pull-object``,
``push-object``): a SuperNode to the SuperLink's Fleet API, the ServerApp to the SuperLink's
Runtime API, a ClientApp to its SuperNode's Runtime API. In a warm 4-node deployment 20 of a node's
26 Fleet calls a round were objects (docs/results/deployment.md, 'The message path, by CPU seconds
per program'), each paying TLS, the gateway, the caller's authentication and an HTTP stack.

Both APIs get two more calls, which take a list of Flower's own per-object requests and answer
with Flower's own per-object responses, in order (a framed stream, as Flower's Control API streams):

- ``pull-objects``: ``PullObjectsRequest {node, items: [PullObjectRequest]}``; the answer stops
  once it holds ``BATCH_BYTES`` of content (always after at least one object) and the caller asks
  again for the rest, so no answer is much larger than a few array chunks.
- ``push-objects``: ``PushObjectsRequest {node, items: [PushObjectRequest]}``; the caller packs a
  request up to ``BATCH_BYTES`` of content (an object larger than that goes alone), so a body stays
  within the gateway's cap of one chunk plus 1 MiB.

Each item is answered by Flower's own handler (the Fleet API's, or the component's Runtime API
handler for the authenticated task), so what a pull or push checks, stores and counts is Flower's.
The two routes enter Flower's table of protobuf routes, which its node and task authentication
read, so a batch is authenticated as a single call is; every item must name the node the request
names, an object at most once, and at most ``MAX_ITEMS`` of them (``batch_problem``), or the whole
request is refused (403): one request never costs more than that many checked single calls. The
gateway holds each item to what it holds a single call to: a node pulls only objects sent to it,
pushes only inside a push session (``fleet_gateway``).

Callers (each falls back to Flower's one call per object, for good, on a 403 or 404):
- a SuperNode (``install``): its connection's ``pull_object`` and ``push_object`` also take a whole
  ``Batch``, which Flower's own call sites in ``start_client_internal`` hand on with the run and
  push session they bind; a node without authentication keys keeps Flower's calls;
- the ServerApp's grid and a ClientApp's runtime (``install_clients``): Flower's
  ``make_*_object_fn_protobuf`` return a ``Remote``, which sends a ``Batch`` through the Runtime API
  client its bound ``PullObject`` or ``PushObject`` belongs to.

Flower's Fleet handler reads the run's status for every object (``check_abort``) and stores every
object's bytes as traffic, a SQLite transaction each: the items of one request are handed a
``RequestState``, which reads the status once per request and stores the summed traffic once.

Nothing anyone stores or sends changes, only how many requests carry it. Each side is guarded
(``check_flower``); a Flower that reads otherwise gets one request per object, with a warning.
"""

import contextlib
import functools
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any

import httpx

from fedvlm.deploy import flower_patches

log = logging.getLogger("fedvlm.deploy")

BATCH_BYTES = 4 << 20  # content per request: a pull's answer stops past it, a push request is packed up to it
MAX_ITEMS = 512  # objects per request (a message of Flower's 5 MiB chunks: 2.5 GiB in one pull request)
PREFIX, RUNTIME = "/v1/fleet", "/v1/runtime"
PULL, PUSH = "/pull-objects", "/push-objects"
ABSENT = (403, 404)  # a SuperLink (or gateway) without the routes
STORED: list[Callable[[], None]] = []  # called after a Runtime push-objects (deploy.long_pulls wakes pulls)
# an object not stored yet (its sender is still pushing it) is asked for again after FIRST_RETRY_S,
# doubling up to MOST_RETRY_S, where Flower asks after 1, 2, 4 and 8 s: nearly every message of a
# deployment would wait that first second (docs/results/deployment.md, 'A message's parts, asked for
# again sooner')
FIRST_RETRY_S, MOST_RETRY_S = 0.05, 1.0


KINDS = {  # the messages these calls add: name -> (field, Flower's message type, repeated)
    "PullObjectsRequest": (("node", "Node", False), ("items", "PullObjectRequest", True)),
    "PushObjectsRequest": (("node", "Node", False), ("items", "PushObjectRequest", True)),
    # deploy.whole_messages: a message with its objects, and the confirmations of those received
    "PullMessageRequest": (("node", "Node", False), ("confirms", "ConfirmMessageReceivedRequest", True)),
    "PulledMessage": (("pulled", "PullMessagesResponse", False), ("objects", "PullObjectResponse", True)),
    "PushMessageRequest": (
        ("node", "Node", False),
        ("push", "PushMessagesRequest", False),
        ("items", "PushObjectRequest", True),
        ("confirms", "ConfirmMessageReceivedRequest", True),
    ),
    "PushedMessage": (("pushed", "PushMessagesResponse", False), ("objects", "PushObjectResponse", True)),
    # deploy.task_input: a ClientApp's task in one call, without the FABs its node has installed
    "TaskInputRequest": (("task", "PullTaskInputRequest", False), ("held", "Fab", True)),
    "TaskInput": (
        ("task", "PullTaskInputResponse", False),
        ("messages", "PullAppMessagesResponse", False),
        ("objects", "PullObjectResponse", True),
    ),
}


@functools.cache
def kinds() -> dict[str, Any]:
    """The classes of ``KINDS``, built from a descriptor at first use (no generated code to keep in
    step): each holds Flower's own requests and responses."""
    from flwr.proto import fab_pb2, fleet_pb2, message_pb2, node_pb2, runtime_pb2  # noqa: F401  (in the pool first)
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    spec = descriptor_pb2.FileDescriptorProto(
        name="fedvlm/object_batches.proto",
        package="fedvlm.fleet",
        syntax="proto3",
        dependency=[f"flwr/proto/{m}.proto" for m in ("fab", "fleet", "message", "node", "runtime")],
    )
    for name, fields in KINDS.items():
        kind = spec.message_type.add(name=name)
        for number, (f, of, repeated) in enumerate(fields, 1):
            label = field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL
            kind.field.add(name=f, number=number, type=field.TYPE_MESSAGE, type_name=f".flwr.proto.{of}", label=label)
    pool = descriptor_pool.Default()
    try:
        found = pool.FindFileByName(spec.name)
    except KeyError:
        found = pool.AddSerializedFile(spec.SerializeToString())
    return {name: message_factory.GetMessageClass(found.message_types_by_name[name]) for name in KINDS}


def requests() -> tuple[Any, Any]:
    """``PullObjectsRequest`` and ``PushObjectsRequest``: a node and a list of Flower's own per-object requests."""
    return kinds()["PullObjectsRequest"], kinds()["PushObjectsRequest"]


def batch_problem(request) -> str | None:
    """Why a batch may not be served (None: it may): every item must name the node the request is
    signed as, name an object once, and the items be at most ``MAX_ITEMS``, so that one request
    costs the SuperLink at most what ``MAX_ITEMS`` single calls, each checked, would."""
    node, count = request.node.node_id, len(request.items)
    if count > MAX_ITEMS:
        return f"node {node} sent a batch of {count} objects; at most {MAX_ITEMS}"
    for item in request.items:
        if item.node.node_id != node:
            return f"node {node} sent a batch with an item for node {item.node.node_id}"
    if len({item.object_id for item in request.items}) != count:
        return f"node {node} sent a batch naming an object twice"
    return None


# ---- the SuperLink -------------------------------------------------------------------------------
class RequestState:
    """The SuperLink's state as the Fleet handlers see it for the items of one request: a run's
    status (``get_run_status``, which Flower's ``check_abort`` reads for every object) read once,
    and the traffic each item records (``store_traffic``) summed and stored once, by ``flush``;
    every other call is the state's own. What a handler decides is unchanged: the status read at
    the request's first item is the one Flower would read a few milliseconds later at its last
    (a run that ends during a request is refused from the next request on, as a single call after
    the end would be), and the traffic stored is the same sum. Never used across a held pull.

    ``pushes``: the request's objects as its handler will store them, in order (run, push session,
    object id, content). Where the state has ``store_objects`` (``deploy.object_uploads``), the first
    ``store_object`` of one stores it and the items after it of the same run and session in one
    transaction, and their own calls get their answers: the handler passes the same checks for each
    of them (the run's status read once, the request's one node), so Flower would have stored them
    one after another."""

    def __init__(self, state: Any, pushes: Iterable[tuple[int, str, str, bytes]] = ()):
        self._state = state
        self._status: dict[int, Any] = {}
        self._traffic: dict[int, tuple[int, int]] = {}
        self._pushes: list[tuple[int, str, str, bytes]] = []
        self._stored: dict[tuple[int, str, str], bool] = {}
        self.expect(pushes)

    def expect(self, pushes: Iterable[tuple[int, str, str, bytes]]) -> None:
        """The objects the request's handler stores next, in order (``pushes``)."""
        self._pushes = list(pushes) if hasattr(self._state, "store_objects") else []

    def get_run_status(self, run_ids: set[int]) -> dict[int, Any]:
        missing = set(run_ids) - set(self._status)
        if missing:
            self._status.update(self._state.get_run_status(missing))
        return {run_id: self._status[run_id] for run_id in run_ids if run_id in self._status}

    def store_traffic(self, run_id: int, *, bytes_sent: int, bytes_recv: int) -> None:
        sent, received = self._traffic.get(run_id, (0, 0))
        self._traffic[run_id] = (sent + bytes_sent, received + bytes_recv)

    def store_object(self, run_id: int, session_id: str, object_id: str, content: bytes) -> bool:
        key = (run_id, session_id, object_id)
        if key not in self._stored:
            at = next((n for n, push in enumerate(self._pushes) if push[:3] == key and push[3] == content), None)
            if at is None:  # not one the request holds: Flower's own call
                return self._state.store_object(run_id, session_id, object_id, content)
            group = list(itertools.takewhile(lambda push: push[:2] == key[:2], self._pushes[at:]))
            answers = self._state.store_objects(run_id, session_id, [(push[2], push[3]) for push in group])
            self._stored.update(zip([push[:3] for push in group], answers, strict=True))
        return self._stored.pop(key)

    def flush(self) -> None:
        for run_id, (sent, received) in self._traffic.items():
            self._state.store_traffic(run_id, bytes_sent=sent, bytes_recv=received)
        self._traffic.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


@contextlib.contextmanager
def one_request(state: Any, pushes: Iterable[tuple[int, str, str, bytes]] = ()) -> Iterator[RequestState]:
    """``state`` for the items of one request; their traffic stored when they are done, or fail."""
    items = RequestState(state, pushes)
    try:
        yield items
    finally:
        items.flush()


def pulled(request, pull_one: Callable) -> list:
    """Flower's answer to each item, in order, up to ``BATCH_BYTES`` of content."""
    answers: list[Any] = []
    size = 0
    for item in request.items:
        if answers and size >= BATCH_BYTES:
            break
        answers.append(pull_one(item))
        size += len(answers[-1].object_content)
    return answers


def _refuse(request) -> None:
    from fastapi import HTTPException

    why = batch_problem(request)
    if why is not None:
        raise HTTPException(status_code=403, detail=why)


def pushes(items: Iterable[Any], run_id: int | None = None) -> Iterator[tuple[int, str, str, bytes]]:
    """Push-object items as their handler stores them: the item's run (the task's, on the Runtime API).
    Lazy: a state without ``store_objects`` never reads (copies) the contents."""
    return ((run_id if run_id is not None else i.run_id, i.session_id, i.object_id, i.object_content) for i in items)


def _fleet_endpoints(handlers) -> dict[str, tuple[Callable, Any, Any]]:
    """The Fleet API's handlers (a SuperNode's calls to the SuperLink): path -> (endpoint, request, answer)."""
    from flwr.proto.message_pb2 import PullObjectResponse, PushObjectResponse

    def fleet_pull_objects(request, state):
        _refuse(request)
        with one_request(state) as items:
            return iter(pulled(request, lambda item: handlers.pull_object(request=item, state=items)))

    def fleet_push_objects(request, state):
        _refuse(request)
        with one_request(state, pushes(request.items)) as items:
            return iter([handlers.push_object(request=item, state=items) for item in request.items])

    pull, push = requests()
    return {
        PULL: (fleet_pull_objects, pull, Iterator[PullObjectResponse]),
        PUSH: (fleet_push_objects, push, Iterator[PushObjectResponse]),
    }


def _runtime_endpoints() -> dict[str, tuple[Callable, Any, Any]]:
    """The Runtime API's two handlers (a ServerApp's calls to the SuperLink, a ClientApp's to its
    SuperNode), each item answered by the component's own handler for the authenticated task."""
    from flwr.proto.message_pb2 import PullObjectResponse, PushObjectResponse

    def runtime_pull_objects(request, state, handlers, task):
        _refuse(request)
        return iter(pulled(request, lambda item: handlers.pull_object(item, state, task)))

    def runtime_push_objects(request, state, handlers, task):
        _refuse(request)
        with one_request(state, pushes(request.items, task.run_id)) as items:
            answers = [handlers.push_object(item, items, task) for item in request.items]
        for stored in STORED:  # after the store: what it stored is committed
            stored()
        return iter(answers)

    pull, push = requests()
    return {
        PULL: (runtime_pull_objects, pull, Iterator[PullObjectResponse]),
        PUSH: (runtime_push_objects, push, Iterator[PushObjectResponse]),
    }


def _annotate(endpoint: Callable, kind: Any, answer: Any, depends: dict[str, Any]) -> Callable:
    """The handler annotated as Flower's own protobuf routes are (FastAPI and ProtobufRoute read them)."""
    from flwr.supercore.protobuf.translation import PROTOBUF_REQUEST_DEPENDENCY

    request = Annotated[kind, PROTOBUF_REQUEST_DEPENDENCY]  # a class made at run time
    endpoint.__annotations__ = {"request": request, **depends, "return": answer}
    return endpoint


def server_parts():
    import importlib

    from flwr.supercore.protobuf import translation
    from flwr.superlink.servicer.fleet import fleet_handlers

    fleet, runtime = (
        importlib.import_module(f"flwr.{m}.router") for m in ("superlink.routers.fleet", "supercore.routers.runtime")
    )
    return fleet, fleet_handlers, runtime, translation


def check_server() -> str | None:
    """Why the installed Flower's Fleet and Runtime routers are not the ones ``serve`` extends."""
    try:
        fleet, handlers, runtime, translation = server_parts()
        from flwr.supercore.dependencies import runtime as depends
    except ImportError as err:
        return f"it does not have {err.name}"
    if fleet.router.prefix != PREFIX or not hasattr(fleet, "LinkStateDependency"):
        return f"its Fleet router is not at {PREFIX} with a LinkStateDependency"
    if runtime.router.prefix != RUNTIME:
        return f"its Runtime router is not at {RUNTIME}"
    if why := flower_patches.lacking(handlers, "pull_object", "push_object"):
        return why
    if not all(hasattr(depends, d) for d in ("RuntimeHandlersDependency", "RuntimeStateDependency", "TaskDependency")):
        return "its Runtime API has other dependencies than a state, its handlers and the task"
    if not isinstance(getattr(translation, "PROTOBUF_REQUEST_TYPES", None), dict):
        return "it has no table of protobuf routes (which its node and task authentication read)"
    return None


def route(router, prefix: str, endpoints: dict[str, tuple[Callable, Any, Any]], depends: dict, table: dict) -> None:
    """Each of ``endpoints`` (path -> endpoint, request kind, answer kind) as a protobuf route of
    ``router``, in Flower's table of protobuf routes (which its node and task authentication read)."""
    served = {r.path for r in router.routes}  # a route served already in this process is not added twice
    for path, (endpoint, kind, answer) in endpoints.items():
        if prefix + path not in served:
            handler = _annotate(endpoint, kind, answer, depends)
            router.add_api_route(path, handler, methods=["POST"], name=endpoint.__name__)
        table[("POST", prefix + path)] = kind  # and is in the table however that was changed since


def serve(fleet_api: bool = True) -> bool:
    """Serve ``pull-objects`` and ``push-objects`` in this process (the SuperLink: on its Fleet and
    Runtime APIs; a SuperNode, ``fleet_api=False``: on its Runtime API, for its ClientApps), before
    it builds its app; False, with a warning, where Flower's routers are not the ones this extends."""
    if not flower_patches.applies("object-batches-served"):
        return False
    fleet, handlers, runtime, translation = server_parts()
    table = translation.PROTOBUF_REQUEST_TYPES
    if fleet_api:
        route(fleet.router, PREFIX, _fleet_endpoints(handlers), {"state": fleet.LinkStateDependency}, table)
    route(runtime.router, RUNTIME, _runtime_endpoints(), runtime_depends(), table)
    return True


def runtime_depends() -> dict[str, Any]:
    """What a Runtime API handler is given, as Flower's own routes declare it: the state, the
    component's handlers and the task the caller's token names."""
    from flwr.supercore.dependencies import runtime as depends

    return {
        "state": depends.RuntimeStateDependency,
        "handlers": depends.RuntimeHandlersDependency,
        "task": depends.TaskDependency,
    }


# ---- the SuperNode -------------------------------------------------------------------------------
class Batch:
    """Every object of one message, handed through Flower's call sites in place of one object id:
    the ids to pull (and what was pulled), or the contents to push."""

    def __init__(self, ids: Iterable[str] | None = None, contents: Iterable[tuple[str, bytes]] | None = None):
        if (ids is None) == (contents is None):
            raise ValueError("a batch is either ids to pull or contents to push")
        self.pulls = ids is not None
        self.ids, self.contents = list(ids or ()), contents or ()
        self.pulled: dict[str, bytes] = {}


def _flower_errors():
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectPushError

    return ObjectPullError, ObjectPushError


def packed(contents: Iterable[tuple[str, bytes]], most: int = BATCH_BYTES) -> Iterator[list[tuple[str, bytes]]]:
    """``contents`` in lists of at most ``most`` bytes of content (a larger object alone) and at
    most ``MAX_ITEMS`` objects."""
    group: list[tuple[str, bytes]] = []
    size = 0
    for item in contents:
        if group and (size + len(item[1]) > most or len(group) == MAX_ITEMS):
            yield group
            group, size = [], 0
        group.append(item)
        size += len(item[1])
    if group:
        yield group


class Link:
    """Batch calls to one API (``prefix``) through a Flower protobuf client that authenticates as
    the caller's own calls do: a SuperNode's to the Fleet API, a ServerApp's or ClientApp's to the
    Runtime API."""

    def __init__(self, client, node_id: int, prefix: str = PREFIX):
        from flwr.proto.node_pb2 import Node

        self.client, self.node, self.prefix, self.served = client, Node(node_id=node_id), prefix, True
        self.ready: dict[str, bytes] = {}  # contents that came with the message just pulled (whole_messages)
        self.whole: Any = None  # the connection's whole-message calls (deploy.whole_messages), on a SuperNode

    def call(self, path: str, items: list) -> list | None:
        """Flower's answers to ``items``, in order (None: the SuperLink has no such call, from now on)."""
        from flwr.proto.message_pb2 import PullObjectResponse, PushObjectResponse

        if not self.served:
            return None
        kind, answer = (requests()[1], PushObjectResponse) if path == PUSH else (requests()[0], PullObjectResponse)
        request = kind(node=self.node, items=items)
        try:
            stream = self.client._unary_stream(
                path=self.prefix + path, rpc_method=f"/fedvlm{self.prefix}{path}", request=request, response_type=answer
            )
            return list(stream)
        except httpx.HTTPStatusError as err:
            if err.response.status_code not in ABSENT:
                raise
            status = err.response.status_code
            log.warning("%s%s answered HTTP %d: one request per object from now on", self.prefix, path, status)
            self.served = False
            return None

    def pull(self, run_id: int, batch: Batch, one: Callable[[str], bytes], flower_pulls: Callable) -> None:
        """Every object of ``batch``; those not stored yet asked for again, as Flower's pulls do, for
        as long (``PULL_MAX_TIME``). Without batches: ``flower_pulls`` with ``one`` per object."""
        from flwr.proto.message_pb2 import PullObjectRequest
        from flwr.supercore.constant import PULL_MAX_TIME

        pull_error = _flower_errors()[0]
        ready, self.ready = self.ready, {}
        batch.pulled.update((i, ready[i]) for i in batch.ids if i in ready)
        left, wait, start = [i for i in batch.ids if i not in ready], FIRST_RETRY_S, time.monotonic()
        while left:
            asked = [PullObjectRequest(node=self.node, run_id=run_id, object_id=i) for i in left[:MAX_ITEMS]]
            answers = self.call(PULL, asked)
            if answers is None:
                batch.pulled.update(flower_pulls(left, one))
                return
            if not answers or len(answers) > len(asked):
                raise pull_error(left[0], f"the SuperLink answered {len(answers)} of {len(asked)} objects")
            waiting = []
            for object_id, answer in zip(left, answers, strict=False):  # an answer may stop early
                if not answer.object_found:
                    raise pull_error(object_id, "the object could not be found.")
                if answer.object_available:
                    batch.pulled[object_id] = answer.object_content
                else:
                    waiting.append(object_id)
            left = left[len(answers) :] + waiting
            if len(waiting) == len(answers):  # nothing asked is there yet: wait, then ask again
                if time.monotonic() - start > PULL_MAX_TIME:
                    raise pull_error(waiting[0], "timeout or retry limit reached")
                time.sleep(wait)
                wait = min(2 * wait, MOST_RETRY_S)

    def push(self, run_id: int, session_id: str, batch: Batch, one: Callable[[int, str, str, bytes], None]) -> None:
        from flwr.proto.message_pb2 import PushObjectRequest

        push_error = _flower_errors()[1]
        for group in packed(batch.contents):
            items = [
                PushObjectRequest(node=self.node, run_id=run_id, object_id=i, object_content=c, session_id=session_id)
                for i, c in group
            ]
            answers = self.call(PUSH, items)
            if answers is None:
                for object_id, content in group:
                    one(run_id, session_id, object_id, content)
                continue
            if len(answers) != len(group) or not all(a.stored for a in answers):
                refused = next((i for (i, _), a in zip(group, answers, strict=False) if not a.stored), group[-1][0])
                raise push_error(refused, run_id, session_id)

    def wrap(self, pull_one: Callable, push_one: Callable) -> tuple[Callable, Callable]:
        """The connection's ``pull_object`` and ``push_object``, which also take a whole ``Batch``."""

        def pull_object(run_id: int, object_id: Any) -> Any:
            if isinstance(object_id, Batch):
                return self.pull(run_id, object_id, functools.partial(pull_one, run_id), FLOWER["pull_objects"])
            return pull_one(run_id, object_id)

        def push_object(run_id: int, session_id: str, object_id: Any, content: bytes) -> None:
            if isinstance(object_id, Batch) and self.whole is not None and self.whole.pending:
                return self.whole.push(run_id, object_id, push_one)  # the reply with its objects
            if isinstance(object_id, Batch):
                return self.push(run_id, session_id, object_id, push_one)
            return push_one(run_id, session_id, object_id, content)

        return pull_object, push_object


FLOWER: dict[str, Callable] = {}  # Flower's own functions, as found before install or install_clients
ACTIVE: list[Link] = []  # the SuperNode's connection that batches (one per process), while it is open


def batching(connect: Callable) -> Callable:
    """Flower's ``http_request_response``, whose ``pull_object`` and ``push_object`` take batches."""

    @contextlib.contextmanager
    def connection(server_address, insecure, root_certificates=None, authentication_keys=None, *rest, **kwargs):
        with connect(server_address, insecure, root_certificates, authentication_keys, *rest, **kwargs) as parts:
            if authentication_keys is None:  # a node that signs nothing: Flower's calls
                yield parts
                return
            with _client(server_address, insecure, root_certificates, authentication_keys) as client:
                link = Link(client, parts[0])
                ACTIVE.append(link)
                try:
                    yield (*parts[:5], *link.wrap(parts[5], parts[6]), *parts[7:])
                finally:
                    ACTIVE.remove(link)

    return connection


def _client(server_address, insecure, root_certificates, keys):
    from pathlib import Path

    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    if isinstance(root_certificates, str):
        root_certificates = str(Path(root_certificates).expanduser())
    interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperNode"), NodeAuthHttpInterceptor(*keys)]
    retries = make_simple_http_retry_invoker()
    return FleetHttpClient.from_server_address(
        server_address, insecure, root_certificates, interceptors=interceptors, retry_invoker=retries
    )


def pull_objects(object_ids: list[str], pull_object_fn: Callable, **kwargs) -> dict[str, bytes]:
    """Flower's ``pull_objects`` as one batch through the node's connection (Flower's where it has none)."""
    if not ACTIVE:
        return FLOWER["pull_objects"](object_ids, pull_object_fn, **kwargs)
    batch = Batch(ids=object_ids)
    pull_object_fn(batch)  # Flower's call site binds the run: pull_object(run_id, batch)
    return batch.pulled


def push_object_contents_from_iterable(
    object_contents: Iterable[tuple[str, bytes]], push_object_fn: Callable, **kwargs
) -> None:
    """Flower's pushes of a reply's objects as batches through the node's connection."""
    if not ACTIVE:
        return FLOWER["push_object_contents_from_iterable"](object_contents, push_object_fn, **kwargs)
    push_object_fn(Batch(contents=object_contents), b"")  # binds run and session: push_object(run, session, batch, b"")
    return None


NODE_NAMES = ("http_request_response", "pull_objects", "push_object_contents_from_iterable")


def check_supernode() -> str | None:
    """Why the installed Flower's SuperNode does not call what ``install`` replaces (None: it does)."""
    import inspect

    try:
        from flwr.supernode import start_client_internal as sci
    except ImportError as err:
        return f"it does not have {err.name}"
    if why := flower_patches.lacking(sci, *NODE_NAMES):
        return why
    source = inspect.getsource(sci)
    if "pull_object_fn=lambda obj_id: pull_object(run_id, obj_id)" not in source:
        return "its SuperNode no longer pulls a message's objects through pull_object(run_id, obj_id)"
    if "push_object_fn=partial(push_object, run_id, session_id)" not in source:
        return "its SuperNode no longer pushes a reply's objects through partial(push_object, run_id, session_id)"
    return None


def check_flower(module) -> str | None:
    """The guard of whichever patch changes ``module`` (``flower_patches``' rows name it)."""
    guards = {
        "flwr.supernode.start_client_internal": check_supernode,
        "flwr.superlink.grid.http_grid": check_runtime_clients,
    }
    return guards.get(module.__name__, check_server)()


def install() -> bool:
    """This SuperNode process sends a message's objects in batches; False, with a warning, where
    Flower's SuperNode does not read as this expects."""

    if not flower_patches.applies("object-batches-sent"):
        return False
    from flwr.supernode import start_client_internal as sci

    for n in NODE_NAMES:
        FLOWER.setdefault(n, getattr(sci, n))
    sci.http_request_response = batching(FLOWER["http_request_response"])
    sci.pull_objects = pull_objects
    sci.push_object_contents_from_iterable = push_object_contents_from_iterable
    return True


# ---- the Runtime API's callers: a deployed ServerApp (to the SuperLink), a ClientApp (to its SuperNode)
class Remote:
    """Flower's per-object function of a Runtime API client (what ``make_pull_object_fn_protobuf``
    and ``make_push_object_fn_protobuf`` return), which also takes a whole ``Batch``: sent as one
    request through the client that ``stub`` (its bound ``PullObject`` or ``PushObject``) belongs to."""

    def __init__(self, one: Callable, stub: Any, node, run_id: int, session_id: str = ""):
        self.one, self.client, self.node_id = one, stub.__self__, node.node_id
        self.run_id, self.session_id = run_id, session_id

    def link(self) -> Link:
        found = LINKS.get(self.client)  # one per client: a Runtime API without batches is asked once
        if found is None:
            found = LINKS[self.client] = Link(self.client, self.node_id, RUNTIME)
        return found

    def __call__(self, object_id, *content):
        if not isinstance(object_id, Batch):
            return self.one(object_id, *content)
        if object_id.pulls:
            return self.link().pull(self.run_id, object_id, self.one, FLOWER["pull_objects"])
        return self.link().push(self.run_id, self.session_id, object_id, lambda _r, _s, i, c: self.one(i, c))


def make_pull_object_fn_protobuf(pull_object_protobuf: Callable, node, run_id: int) -> Callable:
    flower = FLOWER["make_pull_object_fn_protobuf"](pull_object_protobuf, node, run_id)
    return Remote(flower, pull_object_protobuf, node, run_id) if _batchable(pull_object_protobuf) else flower


def make_push_object_fn_protobuf(push_object_protobuf: Callable, node, run_id: int, session_id: str) -> Callable:
    flower = FLOWER["make_push_object_fn_protobuf"](push_object_protobuf, node, run_id, session_id)
    if not _batchable(push_object_protobuf):
        return flower
    return Remote(flower, push_object_protobuf, node, run_id, session_id)


def _batchable(stub: Callable) -> bool:
    """A bound call of a Flower protobuf client (the Runtime API's), whose client can send a batch."""
    return hasattr(getattr(stub, "__self__", None), "_unary_stream")


def runtime_pull_objects(object_ids: list[str], pull_object_fn: Callable, **kwargs) -> dict[str, bytes]:
    """Flower's ``pull_objects``, one batch where ``pull_object_fn`` can send one."""
    if not isinstance(pull_object_fn, Remote):
        return FLOWER["pull_objects"](object_ids, pull_object_fn, **kwargs)
    batch = Batch(ids=object_ids)
    pull_object_fn(batch)
    return batch.pulled


def runtime_push_objects(objects: dict, push_object_fn: Callable, *, object_ids_to_push=None, **kwargs) -> None:
    """Flower's ``push_objects``, in batches where ``push_object_fn`` can send them."""
    if not isinstance(push_object_fn, Remote):
        return FLOWER["push_objects"](objects, push_object_fn, object_ids_to_push=object_ids_to_push, **kwargs)
    wanted = [i for i in objects if object_ids_to_push is None or i in object_ids_to_push]
    push_object_fn(Batch(contents=((i, objects[i].deflate()) for i in wanted)))
    return None


def pull_and_inflate_object_from_tree(object_tree, pull_object_fn: Callable, confirm_object_received_fn, **kwargs):
    """Flower's, its objects pulled in one batch where ``pull_object_fn`` can send one."""
    if not isinstance(pull_object_fn, Remote):
        return FLOWER["pull_and_inflate_object_from_tree"](
            object_tree, pull_object_fn, confirm_object_received_fn, **kwargs
        )
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents, iterate_object_tree

    contents = runtime_pull_objects([t.object_id for t in iterate_object_tree(object_tree)], pull_object_fn)
    confirm_object_received_fn(object_tree.object_id)
    inflated = inflate_object_from_contents(object_tree.object_id, contents, keep_object_contents=False)
    kind = kwargs.get("return_type", object)
    if not isinstance(inflated, kind):
        raise TypeError(f"Expected object of type {kind.__name__}, but got {type(inflated).__name__}.")
    return inflated


LINKS: "weakref.WeakKeyDictionary[Any, Link]" = weakref.WeakKeyDictionary()
CLIENT_MODULES = {  # the Runtime API's callers and the names each imports that this replaces
    "flwr.superlink.grid.http_grid": (
        "make_pull_object_fn_protobuf",
        "make_push_object_fn_protobuf",
        "pull_objects",
        "push_objects",
    ),
    "flwr.supernode.runtime.run_clientapp": (
        "make_pull_object_fn_protobuf",
        "make_push_object_fn_protobuf",
        "pull_and_inflate_object_from_tree",
        "push_objects",
    ),
}
OURS = {
    "make_pull_object_fn_protobuf": make_pull_object_fn_protobuf,
    "make_push_object_fn_protobuf": make_push_object_fn_protobuf,
    "pull_objects": runtime_pull_objects,
    "push_objects": runtime_push_objects,
    "pull_and_inflate_object_from_tree": pull_and_inflate_object_from_tree,
}


def check_runtime_clients() -> str | None:
    """Why the installed Flower's ServerApp grid or ClientApp runtime does not call what
    ``install_clients`` replaces (None: both do)."""
    import importlib

    from flwr.supercore.inflatable import inflatable_protobuf_utils, inflatable_utils

    for name, names in CLIENT_MODULES.items():
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            return f"it does not have {err.name}"
        for n in names:
            source = inflatable_protobuf_utils if n.startswith("make_") else inflatable_utils
            if getattr(module, n, None) is not getattr(source, n, None):
                return f"{name}.{n} is not Flower's {source.__name__}.{n}"
    return None


def install_clients() -> bool:
    """This process's Runtime API calls (a deployed ServerApp's grid, a ClientApp's runtime) send
    a message's objects in batches; False, with a warning, where Flower's do not read as expected."""
    import importlib

    if not flower_patches.applies("object-batches-runtime"):
        return False
    from flwr.supercore.inflatable import inflatable_protobuf_utils, inflatable_utils

    for n in OURS:
        FLOWER.setdefault(n, getattr(inflatable_protobuf_utils if n.startswith("make_") else inflatable_utils, n))
    for name, names in CLIENT_MODULES.items():
        module = importlib.import_module(name)
        for n in names:
            setattr(module, n, OURS[n])
    return True
