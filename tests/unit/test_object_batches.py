"""A message's objects in one Fleet request (``deploy.object_batches``): on Flower's own SuperLink
app the batch routes are authenticated as every Fleet call and serve only the signing node's items;
a node asks again for what is on its way or did not fit, packs pushes under the cap, and falls back
to one request per object where the SuperLink has no batches."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import httpx
import pytest
from flwr.proto.message_pb2 import PullObjectRequest, PullObjectResponse, PushObjectResponse
from flwr.proto.node_pb2 import Node

from fedvlm.deploy import object_batches
from fedvlm.deploy.object_batches import BATCH_BYTES, Batch, Link, packed, requests


@pytest.fixture
def served():
    """Flower's SuperLink app with the batch routes, the router and route table put back after."""
    from flwr.supercore.protobuf import translation
    from flwr.superlink.routers.fleet import router

    routes, table = list(router.router.routes), dict(translation.PROTOBUF_REQUEST_TYPES)
    runtime = object_batches.server_parts()[2].router  # the Runtime API's, which serve() extends too
    runtime_routes = list(runtime.routes)
    try:
        assert object_batches.serve()
        from flwr.superlink.main import create_app

        yield create_app()
    finally:
        router.router.routes[:] = routes
        runtime.routes[:] = runtime_routes
        translation.PROTOBUF_REQUEST_TYPES.clear()
        translation.PROTOBUF_REQUEST_TYPES.update(table)


def _signed(private_key, public_key) -> dict[str, str]:
    """The headers Flower's SuperNode signs every Fleet call with (NodeAuthHttpInterceptor)."""
    from flwr.common.constant import TIMESTAMP_HEADER
    from flwr.supercore.constant import FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER
    from flwr.supercore.date import now
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

    stamp = now().isoformat()
    return {
        "content-type": "application/protobuf",
        FLEET_HTTP_PUBLIC_KEY_HEADER: base64.b64encode(public_key_to_bytes(public_key)).decode(),
        TIMESTAMP_HEADER: stamp,
        FLEET_HTTP_SIGNATURE_HEADER: base64.b64encode(sign_message(private_key, stamp.encode())).decode(),
    }


def test_a_batch_is_authenticated_as_any_fleet_call_and_serves_only_the_signers_items(served):
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes
    from starlette.testclient import TestClient

    pulls = requests()[0]
    keys = generate_key_pairs()
    state = served.state.linkstate_factory.state()
    mine = state.create_node("acct", "org-a", public_key_to_bytes(keys[1]), 30.0)

    def body(node: int, item_node: int) -> bytes:
        item = PullObjectRequest(node=Node(node_id=item_node), run_id=77, object_id="a" * 64)
        return pulls(node=Node(node_id=node), items=[item]).SerializeToString()

    with TestClient(served) as client:
        plain = {"content-type": "application/protobuf"}
        unsigned = client.post("/v1/fleet/pull-objects", content=body(mine, mine), headers=plain)
        assert unsigned.status_code == 401  # Flower's node authentication reads the route
        as_other = client.post("/v1/fleet/pull-objects", content=body(mine + 1, mine + 1), headers=_signed(*keys))
        assert as_other.status_code == 401  # signed by one node's key, naming another
        smuggled = client.post("/v1/fleet/pull-objects", content=body(mine, mine + 1), headers=_signed(*keys))
        assert smuggled.status_code == 403 and f"item for node {mine + 1}" in smuggled.text
        # the signer's own item reaches Flower's handler, which answers as it answers pull-object
        single = PullObjectRequest(node=Node(node_id=mine), run_id=77, object_id="a" * 64).SerializeToString()
        alone = client.post("/v1/fleet/pull-object", content=single, headers=_signed(*keys))
        batched = client.post("/v1/fleet/pull-objects", content=body(mine, mine), headers=_signed(*keys))
        assert batched.status_code == alone.status_code != 200  # run 77 is not running: Flower's refusal
        assert batched.json() == alone.json()


class _Client:
    """A SuperLink's answers to a node's batch calls, scripted: each call pops one list of
    (found, available, content) per item asked for, or an HTTP status."""

    def __init__(self, script: list):
        self.script, self.asked = script, []

    def _unary_stream(self, *, path, rpc_method, request, response_type):
        self.asked.append((path, [item.object_id for item in request.items]))
        answer = self.script.pop(0)
        if isinstance(answer, int):
            raise httpx.HTTPStatusError("no", request=None, response=SimpleNamespace(status_code=answer))  # type: ignore[arg-type]
        if response_type is PushObjectResponse:
            return iter(PushObjectResponse(stored=s) for s in answer)
        return iter(PullObjectResponse(object_found=f, object_available=a, object_content=c) for f, a, c in answer)


def test_a_node_asks_again_only_for_what_is_on_its_way_or_did_not_fit(monkeypatch):
    monkeypatch.setattr(object_batches, "FIRST_RETRY_S", 0.001)
    client = _Client([[(1, 1, b"x"), (1, 0, b"")], [(1, 1, b"z"), (1, 1, b"y")]])  # z did not fit the first answer
    batch = Batch(ids=["x", "y", "z"])
    Link(client, 5).pull(3, batch, lambda *a: pytest.fail("no single pulls"), flower_pulls=None)
    assert batch.pulled == {"x": b"x", "y": b"y", "z": b"z"}
    assert client.asked == [("/v1/fleet/pull-objects", ["x", "y", "z"]), ("/v1/fleet/pull-objects", ["z", "y"])]
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError

    with pytest.raises(ObjectPullError, match="could not be found"):
        Link(_Client([[(0, 0, b"")]]), 5).pull(3, Batch(ids=["q"]), lambda *a: b"", flower_pulls=None)


def test_pushes_are_packed_under_the_cap_and_a_refused_object_fails_the_reply():
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    big, small = b"b" * (BATCH_BYTES - 10), b"s" * 20
    groups = list(packed([("1", small), ("2", small), ("3", big), ("4", small), ("5", b"c" * (2 * BATCH_BYTES))]))
    assert [[i for i, _ in g] for g in groups] == [["1", "2"], ["3"], ["4"], ["5"]]  # a larger object alone
    client = _Client([[True, False]])
    with pytest.raises(ObjectPushError, match="'b'"):
        Link(client, 5).push(3, "s", Batch(contents=[("a", small), ("b", small)]), one=lambda *a: None)


def test_a_superlink_without_batches_gets_one_request_per_object(monkeypatch):
    client = _Client([404])
    link = Link(client, 5)
    flower_pulls = lambda ids, fn: {i: fn(i) for i in ids}  # noqa: E731  (Flower's pull_objects, one call each)
    batch = Batch(ids=["x", "y"])
    link.pull(3, batch, lambda object_id: f"3:{object_id}".encode(), flower_pulls)
    assert batch.pulled == {"x": b"3:x", "y": b"3:y"} and not link.served
    pushed: list = []
    link.push(3, "s", Batch(contents=[("a", b"1")]), one=lambda *a: pushed.append(a))
    assert pushed == [(3, "s", "a", b"1")] and len(client.asked) == 1  # asked once, then never again


class _Runtime:
    """A Runtime API client's shape (Flower's RuntimeHttpClient): per-object calls and the stream
    call the batch goes through, answered from one message's objects."""

    def __init__(self, contents: dict[str, bytes]):
        self.contents, self.asked, self.stored = contents, [], {}

    def PullObject(self, request):  # noqa: N802  (Flower's name)
        pytest.fail("an object pulled alone")

    def PushObject(self, request):  # noqa: N802
        pytest.fail("an object pushed alone")

    def _unary_stream(self, *, path, rpc_method, request, response_type):
        self.asked.append(path)
        if path.endswith("push-objects"):
            self.stored |= {item.object_id: item.object_content for item in request.items}
            return iter(PushObjectResponse(stored=True) for _ in request.items)
        found = (self.contents[item.object_id] for item in request.items)
        return iter(PullObjectResponse(object_found=True, object_available=True, object_content=c) for c in found)


def test_a_runtime_caller_moves_a_whole_message_in_one_request_each_way(monkeypatch):
    """The ClientApp's pull of its instruction and a reply's push (and the ServerApp's, through the
    same two functions) each take one Runtime API request, and the message arrives whole."""
    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.supercore.inflatable import inflatable_protobuf_utils, inflatable_utils
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

    for name in ("pull_objects", "push_objects", "pull_and_inflate_object_from_tree"):
        monkeypatch.setitem(object_batches.FLOWER, name, getattr(inflatable_utils, name))
    for name in ("make_pull_object_fn_protobuf", "make_push_object_fn_protobuf"):
        monkeypatch.setitem(object_batches.FLOWER, name, getattr(inflatable_protobuf_utils, name))
    content = RecordDict({"w": ArrayRecord([np.arange(6.0)]), "config": ConfigRecord({"lr": 0.1})})
    message = Message(content, dst_node_id=7, message_type="train")
    message.metadata.__dict__["_message_id"] = message.object_id
    objects = get_all_nested_objects(message)
    client = _Runtime({i: o.deflate() for i, o in objects.items()})
    confirmed: list[str] = []
    pull = object_batches.make_pull_object_fn_protobuf(client.PullObject, Node(node_id=7), 3)
    got = object_batches.pull_and_inflate_object_from_tree(
        get_object_tree(message), pull, confirmed.append, return_type=Message
    )
    assert got.content["w"].to_numpy_ndarrays()[0].tolist() == list(range(6)) and got.content["config"]["lr"] == 0.1
    assert client.asked == ["/v1/runtime/pull-objects"] and confirmed == [message.object_id]
    push = object_batches.make_push_object_fn_protobuf(client.PushObject, Node(node_id=7), 3, "session")
    object_batches.runtime_push_objects(dict(objects), push, object_ids_to_push=set(list(objects)[1:]))
    assert client.asked[1:] == ["/v1/runtime/push-objects"] and client.stored.keys() == set(list(objects)[1:])


def test_a_runtime_api_without_batches_is_asked_one_object_at_a_time(monkeypatch):
    """A SuperNode or SuperLink that lacks the calls (HTTP 404) gets Flower's per-object pulls,
    from the process's own copy of Flower's functions (the ServerApp and ClientApp have no node's)."""
    from flwr.supercore.inflatable import inflatable_protobuf_utils, inflatable_utils

    monkeypatch.setitem(object_batches.FLOWER, "pull_objects", inflatable_utils.pull_objects)
    monkeypatch.setitem(
        object_batches.FLOWER,
        "make_pull_object_fn_protobuf",
        inflatable_protobuf_utils.make_pull_object_fn_protobuf,
    )

    class Old(_Runtime):
        def _unary_stream(self, **kw):
            self.asked.append(kw["path"])
            raise httpx.HTTPStatusError("no", request=None, response=SimpleNamespace(status_code=404))  # type: ignore[arg-type]

        def PullObject(self, request):  # noqa: N802
            self.asked.append(request.object_id)
            return PullObjectResponse(
                object_found=True, object_available=True, object_content=b"c" + request.object_id.encode()
            )

    client = Old({})
    pull = object_batches.make_pull_object_fn_protobuf(client.PullObject, Node(node_id=7), 3)
    assert object_batches.runtime_pull_objects(["a", "b"], pull) == {"a": b"ca", "b": b"cb"}
    assert object_batches.runtime_pull_objects(["c"], pull) == {"c": b"cc"}
    assert client.asked[0] == "/v1/runtime/pull-objects" and sorted(client.asked[1:]) == ["a", "b", "c"]  # asked once


class _CountingState:
    """A LinkState's calls that Flower's Fleet object handlers make, counted."""

    def __init__(self, status: str):
        self.status, self.status_reads, self.traffic, self.stored = status, 0, [], []

    def get_run_status(self, run_ids):
        from flwr.supercore.run import RunStatus

        self.status_reads += 1
        return {run_id: RunStatus(self.status, "", "") for run_id in run_ids}

    def store_object(self, run_id, session_id, object_id, content):
        self.stored.append(object_id)
        return True

    def store_traffic(self, run_id, *, bytes_sent, bytes_recv):
        self.traffic.append((run_id, bytes_sent, bytes_recv))


def test_the_items_of_one_request_read_the_run_status_once_and_store_the_same_traffic():
    """Flower's handler read the run's status and stored the traffic for every object (two SQLite
    transactions each): through one request's state, once each, and the sums are Flower's."""
    import flwr.superlink.servicer.fleet.fleet_handlers as handlers
    from flwr.common.constant import Status
    from flwr.proto.message_pb2 import PushObjectRequest
    from flwr.supercore.error import FlowerError

    def push(state, i):
        item = PushObjectRequest(node=Node(node_id=3), run_id=7, object_id=f"{i}", object_content=b"x" * (i + 1))
        return handlers.push_object(request=item, state=state)

    alone, batched = _CountingState(Status.RUNNING), _CountingState(Status.RUNNING)
    for i in range(5):
        push(alone, i)
    with object_batches.one_request(batched) as items:
        for i in range(5):
            push(items, i)
    assert (alone.status_reads, batched.status_reads) == (5, 1)
    assert sum(t[2] for t in alone.traffic) == 15 and batched.traffic == [(7, 0, 15)]
    assert alone.stored == batched.stored
    finished = _CountingState(Status.PENDING)  # a run that may not take objects: refused as before
    with pytest.raises(FlowerError), object_batches.one_request(finished) as items:
        push(items, 0)
    assert finished.stored == [] and finished.traffic == []
