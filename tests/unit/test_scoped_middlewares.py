"""The SuperLink's middlewares behind their gates (``deploy.scoped_middlewares``): on Flower's own
app every request gets the answer it got before, a Fleet call no longer enters the Control API's
layers (nor an event log no plugin writes), and a Flower whose layers read otherwise is left as
it is."""

from __future__ import annotations

import functools
import re

import pytest
from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatRequest
from flwr.proto.node_pb2 import Node

from fedvlm.deploy import scoped_middlewares
from tests.unit.test_object_batches import _signed

PLAIN = {"content-type": "application/protobuf"}


@pytest.fixture
def entered(monkeypatch):
    """The names of the gated layers each request enters, in order (their dispatch, counted)."""
    from flwr.superlink import main

    seen: list[str] = []
    for m in main._get_middleware():
        if m.cls.__name__ in scoped_middlewares.ACTS_ON:

            @functools.wraps(m.cls.dispatch)  # the guard reads Flower's source through it
            def counted(self, request, call_next, _flower=m.cls.dispatch, _name=m.cls.__name__):
                seen.append(_name)
                return _flower(self, request, call_next)

            monkeypatch.setattr(m.cls, "dispatch", counted)
    return seen


def _answers(gated: bool, monkeypatch, entered: list[str]) -> list[tuple]:
    """Each probe's (status, body, Cache-Control, layers entered) on a fresh Flower SuperLink app."""
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes
    from flwr.superlink import main
    from starlette.testclient import TestClient

    monkeypatch.setattr(main, "_get_middleware", main._get_middleware)  # put back after the test
    if gated:
        assert scoped_middlewares.install()
    app = main.create_app()
    keys = generate_key_pairs()
    node = app.state.linkstate_factory.state().create_node("acct", "org-a", public_key_to_bytes(keys[1]), 30.0)
    beat = SendNodeHeartbeatRequest(node=Node(node_id=node), heartbeat_interval=30.0).SerializeToString()
    probes = [
        ("/v1/fleet/send-node-heartbeat", beat, _signed(*keys)),  # a node's call, answered
        ("/v1/fleet/send-node-heartbeat", beat, PLAIN),  # unsigned: Flower's node authentication refuses
        ("/v1/control/list-runs", b"", PLAIN),  # the Control API's authentication decides
        ("/v1/control/get-login-details", b"", PLAIN),  # an auth route: no-store added
        ("/v1/runtime/get-nodes", b"", PLAIN),  # a runtime call without a task token
        ("/v1/nowhere", b"", PLAIN),
    ]
    out = []
    with TestClient(app, raise_server_exceptions=False) as client:
        for path, body, headers in probes:
            entered.clear()
            r = client.post(path, content=body, headers=headers)
            body = re.sub(rb"\d{4}-\d\d-\d\dT[\d:.+]+", b"<now>", r.content)  # a reply's own time stamp
            out.append((path, r.status_code, body, r.headers.get("cache-control"), list(entered)))
    return out


def test_every_request_gets_the_same_answer_and_enters_only_the_layers_that_act_on_it(monkeypatch, entered):
    plain = _answers(False, monkeypatch, entered)
    gated = _answers(True, monkeypatch, entered)
    assert [a[:4] for a in gated] == [a[:4] for a in plain]
    assert plain[0][1] == 200 and plain[1][1] == 401 and plain[3][3] == "no-store" and plain[5][1] == 404
    assert [len(a[4]) for a in plain] == [6, 5, 6, 6, 6, 6]  # Flower: all six (the refused one, up to the refusal)
    layers = {a[0]: a[4] for a in gated}
    assert layers["/v1/fleet/send-node-heartbeat"] == ["NodeAuthMiddleware"]  # no Fleet event-log plugin
    assert layers["/v1/runtime/get-nodes"] == [] and layers["/v1/nowhere"] == []
    assert set(layers["/v1/control/list-runs"]) == {
        "ControlSensitiveResponseMiddleware",
        "ControlAuthenticationMiddleware",
    }  # no licence or Control event-log plugin


def test_a_flower_whose_layer_acts_elsewhere_keeps_all_its_layers(monkeypatch):
    from flwr.superlink import main
    from flwr.superlink.routers.fleet.middlewares import FleetEventLogMiddleware

    assert scoped_middlewares.check_flower(main) is None

    async def logs_everything(self, request, call_next):  # a Flower that logs every call, any API
        return await call_next(request)

    monkeypatch.setattr(FleetEventLogMiddleware, "dispatch", logs_everything)
    monkeypatch.setattr(main, "_get_middleware", main._get_middleware)
    assert "FleetEventLogMiddleware.dispatch" in scoped_middlewares.check_flower(main)
    before = main._get_middleware
    assert scoped_middlewares.install() is False
    assert main._get_middleware is before
