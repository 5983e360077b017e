"""What the Fleet gateway lets through (deploy.fleet_gateway): a node pushes only its own replies,
to the SuperLink, each message's id the hash of the fields that route it; bodies past the cap are
refused before they are read; the SuperLink hears the caller's real address."""

from __future__ import annotations

import httpx
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.app.message.message import remove_content_from_message
from flwr.common.serde import message_from_proto, message_to_proto, recorddict_to_proto
from flwr.proto.fleet_pb2 import PushMessagesRequest
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.proto.message_pb2 import Metadata as ProtoMetadata
from flwr.proto.message_pb2 import PushObjectRequest
from flwr.proto.node_pb2 import Node
from flwr.supercore.inflatable.inflatable_object import get_object_tree
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from fedvlm.deploy.fleet_gateway import Limits, check_push, check_push_object, make_app

A, B = 1234, 5678  # two organisations' node ids


def _instruction(dst: int) -> Message:
    md = ProtoMetadata(run_id=5, src_node_id=1, dst_node_id=dst, group_id="2", created_at=1.0, ttl=60.0)
    md.message_type = "train"
    ask = message_from_proto(ProtoMessage(metadata=md, content=recorddict_to_proto(RecordDict())))
    ask.metadata.__dict__["_message_id"] = ask.object_id
    return ask


def _push(reply: Message, node: int) -> PushMessagesRequest:
    """What a SuperNode sends to push ``reply`` (flwr/supernode/fleet_http_connection.py)."""
    reply.metadata.__dict__["_message_id"] = reply.object_id
    return PushMessagesRequest(
        node=Node(node_id=node),
        messages_list=[message_to_proto(remove_content_from_message(reply))],
        message_object_trees=[get_object_tree(reply)],
    )


def _reply(to: Message) -> Message:
    return Message(RecordDict({"metrics": ConfigRecord({"x": 1})}), reply_to=to)


def test_a_nodes_own_reply_passes():
    assert check_push(_push(_reply(_instruction(A)), A).SerializeToString()) is None


@pytest.mark.parametrize(
    "forge, why",
    [
        # A, with its own key, instructs B in the SuperLink's name (the attack that was shown)
        (
            lambda req: (setattr(req.messages_list[0].metadata, "src_node_id", 1), req)[1],
            "pushed a message from node 1",
        ),
        (lambda req: (setattr(req.messages_list[0].metadata, "dst_node_id", B), req)[1], "to node 5678"),
        (lambda req: (setattr(req.messages_list[0].metadata, "reply_to_message_id", ""), req)[1], "answers no message"),
        (lambda req: (req.messages_list.append(req.messages_list[0]), req)[1], "2 messages and 1 trees"),
    ],
)
def test_a_node_cannot_push_what_is_not_its_reply(forge, why):
    body = forge(_push(_reply(_instruction(A)), A)).SerializeToString()
    assert why in (check_push(body) or "")


def test_a_reply_whose_object_names_another_sender_is_refused():
    """A routes its message as its own but pushes an object that says it comes from B: the
    SuperLink stores the object (its hash is right), and the ServerApp would read B's name."""
    theirs = _push(_reply(_instruction(B)), B)  # the object, in B's name
    mine = _push(_reply(_instruction(A)), A)
    mine.message_object_trees[0].CopyFrom(theirs.message_object_trees[0])
    mine.messages_list[0].metadata.message_id = theirs.message_object_trees[0].object_id
    assert "whose id is not the hash of its own fields" in (check_push(mine.SerializeToString()) or "")
    assert check_push(b"\xff\xff not protobuf") == "not a PushMessagesRequest"


def test_an_object_is_pushed_only_inside_a_push_session():
    req = PushObjectRequest(node=Node(node_id=A), run_id=5, object_id="ab" * 32, object_content=b"x")
    assert "outside a push session" in (check_push_object(req.SerializeToString()) or "")
    req.session_id = "s"
    assert check_push_object(req.SerializeToString()) is None


def _gateway(limits: Limits | None = None):
    seen: list = []

    async def echo(request: Request) -> Response:
        seen.append((request.url.path, dict(request.headers), await request.body()))
        return Response(b"ok")

    upstream = Starlette(routes=[Route("/{p:path}", echo, methods=["POST"])])
    return make_app("127.0.0.1:9093", "", limits or Limits(), transport=httpx.ASGITransport(app=upstream)), seen


def test_forged_pushes_never_reach_the_superlink_and_the_real_peer_is_told():
    gateway, seen = _gateway()
    with TestClient(gateway) as client:
        forged = _push(_reply(_instruction(A)), A)
        forged.messages_list[0].metadata.src_node_id = 1
        r = client.post("/v1/fleet/push-messages", content=forged.SerializeToString())
        assert r.status_code == 403 and "pushed a message from node 1" in r.text
        genuine = _push(_reply(_instruction(A)), A).SerializeToString()
        lies = {"x-forwarded-for": "203.0.113.66", "forwarded": "for=203.0.113.66", "x-real-ip": "203.0.113.66"}
        assert client.post("/v1/fleet/push-messages", content=genuine, headers=lies).status_code == 200
    ((path, headers, body),) = seen  # only the genuine reply
    assert path == "/v1/fleet/push-messages" and body == genuine
    assert headers["x-forwarded-for"] == "testclient" and "forwarded" not in headers and "x-real-ip" not in headers


def test_a_body_past_the_cap_is_refused_before_it_is_read():
    gateway, seen = _gateway(Limits(max_body=1000))
    with TestClient(gateway) as client:
        assert client.post("/v1/fleet/pull-messages", content=b"x" * 1000).status_code == 200
        r = client.post("/v1/fleet/pull-messages", content=b"x" * 1001)
        assert r.status_code == 413 and "at most 1000 bytes" in r.text

        def chunks():  # no Content-Length: refused once it has grown past the cap
            for _ in range(50):
                yield b"y" * 100

        assert client.post("/v1/fleet/pull-messages", content=chunks()).status_code == 413
    assert len(seen) == 1
    assert Limits().body == 5 * 2**20 + 2**20  # Flower's largest array chunk and 1 MiB of the rest


def test_the_bodies_held_at_once_are_bounded_in_all_and_by_address():
    """32 unauthenticated bodies just under the cap from one address were buffered whole (the
    gateway from 79 to 622 MiB, the SuperLink behind it parsing each): now a request is counted
    at its declared size before its body is read, and one past the budget is answered 503 at once."""
    import asyncio

    async def scenario() -> list[int]:
        gate = asyncio.Event()

        async def slow(request: Request) -> Response:  # the SuperLink, still busy with each body
            await request.body()
            await gate.wait()
            return Response(b"ok")

        upstream = httpx.ASGITransport(app=Starlette(routes=[Route("/{p:path}", slow, methods=["POST"])]))
        limits = Limits(max_body=1000, max_inflight=3000, max_inflight_per_peer=2000)
        app = make_app("127.0.0.1:9093", "", limits, transport=upstream)

        def caller(address: str) -> httpx.AsyncClient:
            return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(address, 1)), base_url="http://g")

        a, b = caller("198.51.100.1"), caller("198.51.100.2")
        post = "/v1/fleet/pull-messages"
        held = [asyncio.create_task(c.post(post, content=b"x" * 1000)) for c in (a, a, b)]
        await asyncio.sleep(0.2)  # all three bodies are in, their answers awaited
        refused = [
            (await a.post(post, content=b"x" * 10)).status_code,
            (await b.post(post, content=b"x" * 10)).status_code,
        ]
        gate.set()
        answered = [(await t).status_code for t in held]
        after = (await a.post(post, content=b"x" * 1000)).status_code  # given back: room again
        return [*refused, *answered, after]

    assert asyncio.run(scenario()) == [503, 503, 200, 200, 200, 200]


def _sending(tree) -> tuple:
    """A gateway in front of a SuperLink that sends ``tree`` (a message's object tree) to whoever
    pulls messages and answers anything else with a stand-in object; and the paths it heard."""
    from flwr.proto.fleet_pb2 import PullMessagesResponse

    from fedvlm.deploy.object_batches import kinds

    pulled = PullMessagesResponse(message_object_trees=[tree])
    answers = {"pull-messages": pulled.SerializeToString(), "pull-message": kinds()["PulledMessage"](pulled=pulled)}
    seen: list = []

    async def superlink(request: Request) -> Response:
        seen.append(request.url.path)
        answer = answers.get(request.url.path.rsplit("/", 1)[-1], b"the object")
        return Response(answer if isinstance(answer, bytes) else answer.SerializeToString())

    upstream = httpx.ASGITransport(app=Starlette(routes=[Route("/{p:path}", superlink, methods=["POST"])]))
    return make_app("127.0.0.1:9093", "", Limits(), transport=upstream), seen


def test_a_node_pulls_only_the_objects_it_was_sent():
    """pull-object was limited only by knowing an object's id: with ids from the SuperLink's
    database one organisation read another's handshake reply, its instructions and a run's final
    model. Now the gateway learns each node's objects from the pull-messages answers it forwards
    (a message's whole object tree) and forwards pull-object for those only."""
    from flwr.proto.fleet_pb2 import PullMessagesRequest
    from flwr.proto.message_pb2 import ObjectTree, PullObjectRequest

    leaf, content = ObjectTree(object_id="c" * 64), ObjectTree(object_id="b" * 64)
    content.children.append(leaf)
    tree = ObjectTree(object_id="a" * 64)
    tree.children.append(content)
    gateway, seen = _sending(tree)

    def pull(node: int, object_id: str):
        body = PullObjectRequest(node=Node(node_id=node), run_id=1, object_id=object_id).SerializeToString()
        return client.post("/v1/fleet/pull-object", content=body)

    with TestClient(gateway) as client:
        assert pull(A, "a" * 64).status_code == 403  # before it was sent anything
        client.post("/v1/fleet/pull-messages", content=PullMessagesRequest(node=Node(node_id=A)).SerializeToString())
        assert [pull(A, i * 64).status_code for i in "abc"] == [200, 200, 200]  # the message, its content, a leaf
        refused = pull(B, "c" * 64)  # another organisation, knowing the id
        assert refused.status_code == 403 and f"node {B} asked for object cccc" in refused.text
        assert pull(A, "d" * 64).status_code == 403  # an id never sent to anyone
    assert seen.count("/v1/fleet/pull-object") == 3


def test_a_batch_of_objects_passes_only_when_every_item_would_pass_alone():
    """pull-objects and push-objects (deploy.object_batches) carry many per-object requests: the
    gateway holds each item to what it holds a single call to, and every item to the node the
    request is signed as, so a batch cannot smuggle one object another node was sent, one pushed
    outside a push session, or an item in another node's name."""
    from flwr.proto.fleet_pb2 import PullMessagesRequest
    from flwr.proto.message_pb2 import ObjectTree, PullObjectRequest

    from fedvlm.deploy.object_batches import MAX_ITEMS, requests

    pulls, pushes = requests()
    tree = ObjectTree(object_id="a" * 64)
    tree.children.append(ObjectTree(object_id="b" * 64))
    gateway, seen = _sending(tree)

    def pull(node: int, *ids: str, item_node: int | None = None):
        items = [PullObjectRequest(node=Node(node_id=item_node or node), run_id=1, object_id=i) for i in ids]
        body = pulls(node=Node(node_id=node), items=items).SerializeToString()
        return client.post("/v1/fleet/pull-objects", content=body)

    def push(node: int, session: str, item_node: int | None = None, ids: str = "ef"):
        items = [
            PushObjectRequest(node=Node(node_id=item_node or node), run_id=1, object_id=i * 64, session_id=session)
            for i in ids
        ]
        body = pushes(node=Node(node_id=node), items=items).SerializeToString()
        return client.post("/v1/fleet/push-objects", content=body)

    with TestClient(gateway) as client:
        client.post("/v1/fleet/pull-messages", content=PullMessagesRequest(node=Node(node_id=A)).SerializeToString())
        assert pull(A, "a" * 64, "b" * 64).status_code == 200
        unsent = pull(A, "a" * 64, "d" * 64)  # one object never sent, behind one that was
        assert unsent.status_code == 403 and f"node {A} asked for object dddd" in unsent.text
        assert pull(B, "b" * 64).status_code == 403  # sent to A, asked by B
        smuggled = pull(B, "b" * 64, item_node=A)  # signed as B, the item in A's name
        assert smuggled.status_code == 403 and f"item for node {A}" in smuggled.text
        assert push(A, "s").status_code == 200
        assert "outside a push session" in push(A, "").text
        assert push(B, "s", item_node=A).status_code == 403
        twice = push(A, "s", ids="ee")  # one object named twice: one request costing two lookups of it
        assert twice.status_code == 403 and "naming an object twice" in twice.text
        many = pull(A, *(f"{i:064x}" for i in range(MAX_ITEMS + 1)))  # more items than a request may cost
        assert many.status_code == 403 and f"at most {MAX_ITEMS}" in many.text
        assert client.post("/v1/fleet/pull-objects", content=b"\xff\xff").status_code == 403
    assert seen.count("/v1/fleet/pull-objects") == 1 and seen.count("/v1/fleet/push-objects") == 1


def test_an_unregistered_key_is_answered_as_flowers_failed_activation_and_names_the_fix():
    """A 401 for an unregistered key made Flower's SuperNode signal itself and exit 0, saying only
    that it 'terminated gracefully' (found by tests/e2e/test_docker.py). The gateway now answers as
    the SuperLink does for a key it does not know: 412 with Flower's error, which Flower's
    SuperNode reads (``FlowerError.from_json``), prints and exits 1 on; a bad signature stays 401."""
    from flwr.supercore.error import ApiErrorCode, FlowerError

    from fedvlm.deploy.fleet_gateway import UNREGISTERED, auth_refusal

    answer = auth_refusal(UNREGISTERED)
    err = FlowerError.from_json(bytes(answer.body).decode())
    assert answer.status_code == 412 and err is not None
    assert err.code == ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED and err.message == "Failed to activate SuperNode."
    assert "flwr supernode register" in (err.public_details or "") and "--node-keys" in (err.public_details or "")
    assert auth_refusal("its signature does not verify").status_code == 401


def test_a_whole_message_passes_part_by_part_and_a_node_confirms_only_its_own():
    """pull-message and push-message (deploy.whole_messages) carry a message, its objects and the
    node's confirmations: each part is held to its single call's check. A confirmation deletes a
    message's objects on the SuperLink, so confirm-message-received, alone or carried, must name a
    message sent to that node (before, any organisation could take another's instruction away)."""
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest, ObjectTree, PullObjectRequest

    from fedvlm.deploy.object_batches import kinds
    from fedvlm.deploy.whole_messages import MAX_CONFIRMS

    tree = ObjectTree(object_id="a" * 64)
    tree.children.append(ObjectTree(object_id="b" * 64))
    gateway, seen = _sending(tree)
    pull, push = kinds()["PullMessageRequest"], kinds()["PushMessageRequest"]

    def confirm(node: int, object_id: str = "a" * 64):
        return ConfirmMessageReceivedRequest(node=Node(node_id=node), run_id=5, message_object_id=object_id)

    def post(path: str, request) -> httpx.Response:
        return client.post(f"/v1/fleet/{path}", content=request.SerializeToString())

    reply = _reply(_instruction(A))
    request = _push(reply, A)
    reply_ids = [
        request.message_object_trees[0].object_id,
        *(c.object_id for c in request.message_object_trees[0].children),
    ]

    def pushed(node: int = A, ids=reply_ids, confirms=(), of=request):
        items = [PushObjectRequest(node=Node(node_id=node), run_id=5, object_id=i) for i in ids]
        return post("push-message", push(node=Node(node_id=node), push=of, items=items, confirms=list(confirms)))

    with TestClient(gateway) as client:
        early = post("confirm-message-received", confirm(A))
        assert early.status_code == 403 and "was not sent to it" in early.text  # nothing was sent to A yet
        assert post("pull-message", pull(node=Node(node_id=A), confirms=[confirm(A)])).status_code == 403
        assert post("pull-message", pull(node=Node(node_id=A))).status_code == 200  # learnt as pull-messages is
        assert (
            post(
                "pull-objects",
                kinds()["PullObjectsRequest"](
                    node=Node(node_id=A), items=[PullObjectRequest(node=Node(node_id=A), run_id=5, object_id="b" * 64)]
                ),
            ).status_code
            == 200
        )
        assert post("confirm-message-received", confirm(B)).status_code == 403  # A's message, confirmed by B
        assert post("confirm-message-received", confirm(A)).status_code == 200
        assert post("pull-message", pull(node=Node(node_id=A), confirms=[confirm(A)])).status_code == 200
        assert pushed().status_code == 200 and pushed(confirms=[confirm(A)]).status_code == 200
        stray = pushed(ids=[*reply_ids, "e" * 64])  # an object of no part of this reply
        assert stray.status_code == 403 and "of another message" in stray.text
        assert pushed(confirms=[confirm(A, "f" * 64)]).status_code == 403  # a message never sent to A
        forged = _push(_reply(_instruction(A)), A)
        forged.messages_list[0].metadata.src_node_id = B
        assert "pushed a message from node" in pushed(of=forged).text  # checked as push-messages is
        assert pushed(node=B).status_code == 403  # A's reply in a request of B's
        many = [confirm(A, f"{i:064x}") for i in range(MAX_CONFIRMS + 1)]
        assert post("pull-message", pull(node=Node(node_id=A), confirms=many)).status_code == 403
        assert client.post("/v1/fleet/push-message", content=b"\xff\xff").status_code == 403
    assert seen.count("/v1/fleet/pull-message") == 2 and seen.count("/v1/fleet/push-message") == 2
    assert seen.count("/v1/fleet/confirm-message-received") == 1
