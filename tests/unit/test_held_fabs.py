"""Issue 64: a ClientApp's task input comes without the FAB its node has installed already
(``deploy.held_fabs``), from a real SuperNode app and Flower's own ClientApp client, and the pin
still decides what runs."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from fastapi.testclient import TestClient
from flwr.common import Context, RecordDict
from flwr.proto.fab_pb2 import Fab as FabProto
from flwr.proto.runtime_pb2 import PullTaskInputRequest, PullTaskInputResponse
from flwr.supercore.constant import TASK_TOKEN_HEADER, TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.interceptors.http.runtime_token import RuntimeTokenHttpInterceptor
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.runtime.runtime_http_client import RuntimeHttpClient
from flwr.supernode.nodestate import NodeStateFactory

from fedvlm.deploy import held_fabs, object_batches
from fedvlm.deploy.pinned_app import AppNotPinned, check_task_fab

CONTENT = b"PK a stand-in FAB" * 4096
DIGEST = hashlib.sha256(CONTENT).hexdigest()
PROTOBUF = {"content-type": "application/protobuf", "accept": "application/protobuf"}


@pytest.fixture
def supernode():
    """Flower's SuperNode app over an in-memory node state holding one run with a FAB, serving the
    held-FAB route as ``supernode_polling`` serves it; ``task()`` claims a new ClientApp task."""
    assert object_batches.serve(fleet_api=False) and held_fabs.serve()
    from flwr.supernode.main import create_app

    factory = NodeStateFactory(ObjectStoreFactory())
    state = factory.state()
    assert state.store_fab(Fab(hash_str="", content=CONTENT, verifications={})) == DIGEST
    run = dataclasses.replace(Run.create_empty(7), fab_id="someone/demo", fab_version="1.0.0", fab_hash=DIGEST)
    state.store_run(dataclasses.replace(run, series_id=3))
    state.set_run_series_context(3, Context(run_id=7, node_id=1, node_config={}, state=RecordDict(), run_config={}))

    def task() -> str:
        return state.claim_task(state.create_task(TaskType.CLIENT_APP, 7))

    return TestClient(create_app(factory)), task


def _ask(app: TestClient, token: str, held: list[str]) -> tuple[int, PullTaskInputResponse]:
    kind = object_batches.kinds()["PullTaskInputHeldRequest"]
    body = kind(task=PullTaskInputRequest(), held=[FabProto(hash_str=h) for h in held]).SerializeToString()
    answer = app.post(
        object_batches.RUNTIME + held_fabs.ROUTE, content=body, headers={**PROTOBUF, TASK_TOKEN_HEADER: token}
    )
    parsed = PullTaskInputResponse()
    if answer.status_code == 200:
        parsed.ParseFromString(answer.content)
    return answer.status_code, parsed


def test_the_supernode_leaves_out_only_a_fab_the_clientapp_holds(supernode):
    app, task = supernode
    status, answer = _ask(app, task(), [DIGEST])
    assert status == 200 and answer.fab.content == b"" and answer.fab.hash_str == DIGEST
    assert answer.run.fab_id == "someone/demo" and answer.context.run_id == 7  # the rest is Flower's answer
    for held in ([], ["0" * 64], [DIGEST[:8] + "0" * 56]):  # not held, another FAB, a prefix's namesake
        status, answer = _ask(app, task(), held)
        assert status == 200 and answer.fab.content == CONTENT and answer.fab.hash_str == DIGEST
    assert _ask(app, "not-a-token", [DIGEST])[0] in (401, 403)  # the task's token is checked as on Flower's route
    token = task()
    assert _ask(app, token, [DIGEST])[0] == 200
    assert _ask(app, token, [DIGEST])[0] != 200  # a task starts once, as with Flower's pull-task-input


def _flower_pull(app: TestClient, token: str, pins: set[str]):
    """Flower's own ClientApp pull (``run_clientapp.pull_task_input``) through the held-FAB puller."""
    client = RuntimeHttpClient.from_server_address(
        server_address="testserver",
        insecure=True,
        root_certificates=None,
        interceptors=[RuntimeTokenHttpInterceptor(token)],
    )
    client._client = app  # Flower's client, talking to the app in this process
    client.PullTaskInput = puller = held_fabs.Puller(client, pins)
    return puller, client.PullTaskInput(PullTaskInputRequest())


def test_a_clientapp_names_the_pinned_fabs_installed_on_its_node(supernode, tmp_path, monkeypatch):
    app, task = supernode
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    puller, answer = _flower_pull(app, task(), {DIGEST})
    assert puller.held == [] and puller.withheld is None and answer.fab.content == CONTENT  # nothing installed
    (tmp_path / "apps" / f"someone.demo.1.0.0.{DIGEST[:8]}").mkdir(parents=True)
    puller, answer = _flower_pull(app, task(), {DIGEST, "ab" * 32})
    assert puller.held == [DIGEST] and puller.withheld == DIGEST and answer.fab.content == b""
    assert (
        held_fabs.installed("someone/demo", "1.0.0", DIGEST) == tmp_path / "apps" / f"someone.demo.1.0.0.{DIGEST[:8]}"
    )
    puller, answer = _flower_pull(app, task(), {"ab" * 32})  # the run's FAB is not pinned: its bytes come
    assert puller.withheld is None and answer.fab.content == CONTENT
    (tmp_path / "apps" / f"someone.demo.1.0.0.{DIGEST[:8]}").rmdir()
    with pytest.raises(held_fabs.FabWithheld, match="removed"):
        held_fabs.installed("someone/demo", "1.0.0", DIGEST)


def test_a_supernode_without_the_route_gets_flowers_pull(supernode, tmp_path, monkeypatch):
    app, task = supernode
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    (tmp_path / "apps" / f"someone.demo.1.0.0.{DIGEST[:8]}").mkdir(parents=True)
    router = object_batches.server_parts()[2].router  # Flower's Runtime router, which the app includes
    monkeypatch.setattr(router, "routes", [r for r in router.routes if not r.path.endswith(held_fabs.ROUTE)])
    puller, answer = _flower_pull(app, task(), {DIGEST})
    assert puller.held == [DIGEST] and puller.withheld is None and answer.fab.content == CONTENT


def test_the_pin_decides_what_runs_when_the_bytes_are_left_out():
    pins = frozenset({DIGEST})
    assert check_task_fab(b"", DIGEST, pins, "someone/demo 1.0.0") == DIGEST  # withheld, pinned
    with pytest.raises(AppNotPinned, match="someone/demo 1.0.0 has sha256 " + "cd" * 32):
        check_task_fab(b"", "cd" * 32, pins, "someone/demo 1.0.0")  # withheld, not pinned
    with pytest.raises(AppNotPinned):
        check_task_fab(b"", None, pins, "someone/demo 1.0.0")  # no bytes and nothing withheld: the empty FAB's digest
    with pytest.raises(AppNotPinned):
        check_task_fab(b"other bytes", DIGEST, pins, "x")  # bytes that came are what is checked
