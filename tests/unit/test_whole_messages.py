"""A SuperNode's message and its objects in one request each way (``deploy.whole_messages``): on
Flower's own SuperLink app the two routes are authenticated as every Fleet call and refuse any part
in another node's name; the node's connection pulls a message with its contents and pushes a reply
with its objects, sends its confirmations with its next call, keeps them when that call fails, and
falls back to Flower's calls where the SuperLink has none."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.serde import message_to_proto
from flwr.proto.fleet_pb2 import PullMessagesResponse, PushMessagesRequest, PushMessagesResponse
from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest, PullObjectResponse, PushObjectRequest
from flwr.proto.message_pb2 import PushObjectResponse as Stored
from flwr.proto.node_pb2 import Node
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree

from fedvlm.deploy import object_batches, whole_messages
from fedvlm.deploy.object_batches import BATCH_BYTES, Batch, Link, kinds
from fedvlm.deploy.whole_messages import MAX_CONFIRMS, Messages
from tests.unit.test_object_batches import _signed


@pytest.fixture
def served():
    """Flower's SuperLink app with the whole-message and batch routes, put back after."""
    from flwr.supercore.protobuf import translation
    from flwr.superlink.routers.fleet import router

    routes, table = list(router.router.routes), dict(translation.PROTOBUF_REQUEST_TYPES)
    try:
        assert object_batches.serve() and whole_messages.serve()
        from flwr.superlink.main import create_app

        yield create_app()
    finally:
        router.router.routes[:] = routes
        translation.PROTOBUF_REQUEST_TYPES.clear()
        translation.PROTOBUF_REQUEST_TYPES.update(table)


def _message(size: int = 6) -> Message:
    content = RecordDict({"w": ArrayRecord([np.arange(float(size))]), "config": ConfigRecord({"lr": 0.1})})
    message = Message(content, dst_node_id=7, message_type="train")
    message.metadata.__dict__["_run_id"] = 3
    message.metadata.__dict__["_message_id"] = message.object_id
    return message


def test_every_part_must_name_the_signing_node_on_flowers_superlink(served):
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes
    from starlette.testclient import TestClient

    keys = generate_key_pairs()
    state = served.state.linkstate_factory.state()
    mine = state.create_node("acct", "org-a", public_key_to_bytes(keys[1]), 30.0)
    pull, push = kinds()["PullMessageRequest"], kinds()["PushMessageRequest"]

    def confirm(node: int, object_id: str = "a" * 64):
        return ConfirmMessageReceivedRequest(node=Node(node_id=node), run_id=3, message_object_id=object_id)

    def post(path: str, request, headers=None):
        return client.post(f"/v1/fleet/{path}", content=request.SerializeToString(), headers=headers or _signed(*keys))

    me, other = Node(node_id=mine), Node(node_id=mine + 1)
    with TestClient(served) as client:
        plain = {"content-type": "application/protobuf"}
        assert post("pull-message", pull(node=me), plain).status_code == 401  # Flower's node authentication
        assert post("pull-message", pull(node=other), None).status_code == 401  # signed by one node, naming another
        smuggled = post("pull-message", pull(node=me, confirms=[confirm(mine + 1)]))
        assert smuggled.status_code == 403 and "confirmation for another node" in smuggled.text
        twice = post("pull-message", pull(node=me, confirms=[confirm(mine), confirm(mine)]))
        assert twice.status_code == 403 and "confirmed a message twice" in twice.text
        many = pull(node=me, confirms=[confirm(mine, f"{i:064x}") for i in range(MAX_CONFIRMS + 1)])
        assert post("pull-message", many).status_code == 403
        other_push = post("push-message", push(node=me, push=PushMessagesRequest(node=other)))
        assert other_push.status_code == 403 and f"messages for node {mine + 1}" in other_push.text
        item = PushObjectRequest(node=other, run_id=3, object_id="b" * 64)
        foreign = post("push-message", push(node=me, push=PushMessagesRequest(node=me), items=[item]))
        assert foreign.status_code == 403 and f"item for node {mine + 1}" in foreign.text
        # a well-formed pull reaches Flower's handler on the real state: nothing is waiting for this node
        empty = post("pull-message", pull(node=me))
        assert empty.status_code == 200
        answer = kinds()["PulledMessage"].FromString(empty.content)
        assert not answer.pulled.messages_list and not answer.objects


class _Client:
    """A SuperLink's answers to one node, scripted per path: a list of answers (an int: that HTTP
    status) for the unary calls, and the contents the stream calls (pull-objects, push-objects) serve."""

    def __init__(self, script: dict, contents: dict | None = None):
        self.script, self.contents, self.asked, self.stored = script, contents or {}, [], {}

    def _unary_unary(self, *, path, rpc_method, request, response_type):
        self.asked.append((path, request))
        answer = self.script[path].pop(0)
        if isinstance(answer, int):
            raise httpx.HTTPStatusError("no", request=None, response=SimpleNamespace(status_code=answer))  # type: ignore[arg-type]
        return answer(request) if callable(answer) else answer

    def _unary_stream(self, *, path, rpc_method, request, response_type):
        self.asked.append((path, request))
        if path.endswith("push-objects"):
            self.stored |= {item.object_id: item.object_content for item in request.items}
            return iter(Stored(stored=True) for _ in request.items)
        return iter(
            PullObjectResponse(object_found=True, object_available=True, object_content=self.contents[i.object_id])
            for i in request.items
        )


def _flower(calls: list):
    """Flower's receive, send and confirm, recording their calls."""
    return (
        lambda: calls.append("receive"),
        lambda *a: (calls.append(("send", a[0].object_id)), ({"x"}, "flower-session"))[1],
        lambda run, object_id: calls.append(("confirm", run, object_id)),
    )


def test_a_message_arrives_with_its_contents_and_only_what_did_not_fit_is_pulled_again():
    message = _message()
    tree = get_object_tree(message)
    ids = [t.object_id for t in iterate_object_tree(tree)]
    contents = {i: o.deflate() for i, o in get_all_nested_objects(message).items()}
    first = [PullObjectResponse(object_found=True, object_available=True, object_content=contents[i]) for i in ids[:2]]
    first.append(PullObjectResponse(object_found=True, object_available=False))  # not stored yet on the SuperLink
    pulled = PullMessagesResponse(messages_list=[message_to_proto(message)], message_object_trees=[tree])
    client = _Client({"/v1/fleet/pull-message": [kinds()["PulledMessage"](pulled=pulled, objects=first)]}, contents)
    link = Link(client, 7)
    messages = link.whole = Messages(link, _flower(calls := []))
    messages.confirm(3, "earlier" * 9)  # a confirmation waiting for the node's next call
    got, got_tree = messages.receive()
    assert got.object_id == message.object_id and got_tree == tree and not calls
    sent = client.asked[0][1]
    assert [c.message_object_id for c in sent.confirms] == ["earlier" * 9] and not messages.confirms
    batch = Batch(ids=ids)
    link.pull(3, batch, lambda *a: pytest.fail("no single pulls"), flower_pulls=None)
    assert batch.pulled == contents  # the message arrived whole
    asked_again = [item.object_id for item in client.asked[1][1].items]
    assert client.asked[1][0] == "/v1/fleet/pull-objects" and asked_again == ids[2:]


def test_a_reply_leaves_with_its_objects_and_the_superlink_decides_which_it_keeps():
    reply = _message(size=0)  # three arrays of 1.5 MiB: two fit the first request, the rest go by push-objects
    reply.content["w"] = ArrayRecord([np.full(BATCH_BYTES // 8 // 3 + 1024, float(k)) for k in range(3)])
    reply.metadata.__dict__["_message_id"] = reply.object_id
    tree = get_object_tree(reply)
    objects = {i: o.deflate() for i, o in get_all_nested_objects(reply).items()}
    ids = [t.object_id for t in iterate_object_tree(tree)]
    unwanted = ids[0]  # one the SuperLink already holds: answered unstored, not pushed again

    def pushed(request):
        stored = [Stored(stored=item.object_id != unwanted) for item in request.items]
        answer = PushMessagesResponse(objects_to_push=[i for i in ids if i != unwanted], session_id="s1")
        return kinds()["PushedMessage"](pushed=answer, objects=stored)

    client = _Client({"/v1/fleet/push-message": [pushed]})
    link = Link(client, 7)
    messages = link.whole = Messages(link, _flower(calls := []))
    _, push = link.wrap(lambda *a: pytest.fail("single pull"), lambda *a: pytest.fail("single push"))
    wanted, session = messages.send(reply, tree, 1.5)
    assert wanted == set(ids) and session == ""  # known only once the push is answered
    push(3, session, Batch(contents=((i, objects[i]) for i in ids)), b"")
    path, first = client.asked[0]
    assert path == "/v1/fleet/push-message" and first.push.clientapp_runtime_list == [1.5]
    assert first.push.messages_list[0].metadata.message_id == reply.object_id and not calls
    rest = [r for p, r in client.asked[1:]]
    assert all(p == "/v1/fleet/push-objects" for p, _ in client.asked[1:]) and rest
    assert all(item.session_id == "s1" for r in rest for item in r.items)  # in the session the push opened
    sent_first = [item.object_id for item in first.items]
    assert sent_first == ids[: len(sent_first)] and 0 < len(sent_first) < len(ids)  # in order, within the cap
    assert first.ByteSize() <= BATCH_BYTES + 1024 and unwanted in sent_first and unwanted not in client.stored
    assert set(sent_first) | client.stored.keys() == set(ids)  # every other object pushed once


def test_a_failed_call_keeps_the_confirmations_and_a_superlink_without_the_calls_gets_flowers():
    client = _Client({"/v1/fleet/pull-message": [503, 404]})
    link = Link(client, 7)
    messages = link.whole = Messages(link, _flower(calls := []))
    messages.confirm(3, "m" * 64)
    with pytest.raises(httpx.HTTPStatusError):
        messages.receive()
    assert [c.message_object_id for c in messages.confirms] == ["m" * 64]  # kept for the next call
    assert messages.receive() is None and calls == [("confirm", 3, "m" * 64), "receive"]  # Flower's, from now on
    messages.confirm(3, "n" * 64)
    assert calls[-1] == ("confirm", 3, "n" * 64) and not messages.served
    reply = _message()
    assert messages.send(reply, get_object_tree(reply), 0.0) == ({"x"}, "flower-session")
    assert len(client.asked) == 2  # asked twice (a failure, then the refusal), never again


def test_the_installed_superlink_serves_both_calls_as_flowers_protobuf_routes(served):
    from flwr.supercore.protobuf import translation

    table = translation.PROTOBUF_REQUEST_TYPES
    assert table[("POST", "/v1/fleet/pull-message")] is kinds()["PullMessageRequest"]
    assert table[("POST", "/v1/fleet/push-message")] is kinds()["PushMessageRequest"]
    assert ("POST", "/v1/runtime/pull-message") not in table  # the Runtime API keeps its object batches only
    import flwr.supernode.start_client_internal as sci
    from flwr.superlink.routers.fleet import router

    assert whole_messages.check_flower(sci) is None and whole_messages.check_flower(router) is None


def test_the_superlink_answers_a_messages_objects_in_tree_order_up_to_the_cap_waiting_for_late_ones(monkeypatch):
    """``pull-message``'s objects: Flower's pull_object answers in the tree's order, an object the
    ServerApp has not stored yet waited for (briefly), and nothing past ``BATCH_BYTES`` of content."""
    import asyncio

    from fedvlm.deploy import whole_messages as wm

    monkeypatch.setattr(wm, "FIRST_WAIT_S", 0.001)
    arrays = ArrayRecord([np.full(BATCH_BYTES // 8 // 3 + 1024, float(k)) for k in range(3)])  # over the cap in all
    message = Message(RecordDict({"w": arrays}), dst_node_id=7, message_type="train")
    message.metadata.__dict__["_run_id"] = 3
    message.metadata.__dict__["_message_id"] = message.object_id
    tree = get_object_tree(message)
    contents = {i: o.deflate() for i, o in get_all_nested_objects(message).items()}
    ids = [t.object_id for t in iterate_object_tree(tree)]
    late, asked = ids[1], []  # stored only once asked twice

    def pull_object(request, state):
        asked.append(request.object_id)
        if request.object_id == late and asked.count(late) < 2:
            return PullObjectResponse(object_found=True, object_available=False)
        return PullObjectResponse(object_found=True, object_available=True, object_content=contents[request.object_id])

    pulled = PullMessagesResponse(messages_list=[message_to_proto(message)], message_object_trees=[tree])
    handlers = SimpleNamespace(pull_object=pull_object)
    answers = asyncio.run(wm._objects(handlers, Node(node_id=7), pulled, state=None))
    got = [a.object_content for a in answers]
    assert got == [contents[i] for i in ids[: len(got)]] and asked.count(late) == 2  # in order, the late one too
    assert 0 < len(got) < len(ids) and sum(map(len, got[:-1])) < BATCH_BYTES <= sum(map(len, got))  # stops past the cap
    assert not asyncio.run(wm._objects(handlers, Node(node_id=7), PullMessagesResponse(), state=None))


def test_a_reply_whose_message_is_large_itself_stays_within_the_gateways_cap():
    """An error reply carries its reason in the message (the hostile node's 5 MB reason): the
    objects beside it in push-message fit what the message leaves of ``BATCH_BYTES``, so the body
    stays within the gateway's cap (a chunk plus 1 MiB), and the rest go by push-objects."""
    from flwr.app import Error

    from fedvlm.deploy.fleet_gateway import Limits
    from fedvlm.deploy.whole_messages import within

    reply = Message(Error(code=0, reason="RuntimeError: " + "a 5 MB reason " * 380_000), reply_to=_message())
    reply.metadata.__dict__["_message_id"] = reply.object_id
    tree = get_object_tree(reply)
    objects = {i: o.deflate() for i, o in get_all_nested_objects(reply).items()}
    ids = [t.object_id for t in iterate_object_tree(tree)]

    def pushed(request):
        answer = PushMessagesResponse(objects_to_push=ids, session_id="s1")
        return kinds()["PushedMessage"](pushed=answer, objects=[Stored(stored=True) for _ in request.items])

    client = _Client({"/v1/fleet/push-message": [pushed]})
    link = Link(client, 7)
    messages = link.whole = Messages(link, _flower([]))
    _, push = link.wrap(lambda *a: pytest.fail("single pull"), lambda *a: pytest.fail("single push"))
    push(3, messages.send(reply, tree, 0.5)[1], Batch(contents=((i, objects[i]) for i in ids)), b"")
    first = client.asked[0][1]
    assert first.ByteSize() <= Limits().body and not first.items  # the 5.3 MB message leaves no room beside it
    assert client.stored.keys() == set(ids) and client.asked[1][0] == "/v1/fleet/push-objects"
    fits, rest = within([("a", b"1" * 10), ("b", b"2" * 10), ("c", b"3")], 15)
    assert fits == [("a", b"1" * 10)] and list(rest) == [("b", b"2" * 10), ("c", b"3")]  # in order, nothing lost
