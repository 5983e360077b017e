"""Issue 64: a ClientApp's task comes in one call, without the FAB its node has installed already
(``deploy.task_input``), from a real SuperNode app to Flower's own ClientApp client and runtime,
and the pin still decides what runs."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from fastapi.testclient import TestClient
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.proto.fab_pb2 import Fab as FabProto
from flwr.proto.runtime_pb2 import PullTaskInputRequest
from flwr.supercore.constant import TASK_TOKEN_HEADER, TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.interceptors.http.runtime_token import RuntimeTokenHttpInterceptor
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.runtime.runtime_http_client import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.nodestate import NodeStateFactory
from flwr.supernode.runtime import run_clientapp
from flwr.supernode.start_client_internal import _insert_message

from fedvlm.deploy import object_batches, task_input
from fedvlm.deploy.pinned_app import AppNotPinned, check_task_fab

CONTENT = b"PK a stand-in FAB" * 4096
DIGEST = hashlib.sha256(CONTENT).hexdigest()
PROTOBUF = {"content-type": "application/protobuf", "accept": "application/protobuf"}
RUN = 7


@pytest.fixture
def supernode(monkeypatch):
    """Flower's SuperNode app over an in-memory node state holding one run with a FAB, serving
    ``/pull-task`` as ``supernode_polling`` serves it; ``task(rows)`` stores an instruction (two
    arrays of ``rows`` x 512 floats: 4.2 MB, past one answer's cap, at the default) and claims a
    ClientApp task for it."""
    assert object_batches.serve(fleet_api=False) and task_input.serve()
    from flwr.supernode.main import create_app

    for name, value in (("_run_id", RUN), ("_node_id", 0), ("_task_id", 1)):  # a ServerApp's, while it sends
        monkeypatch.setattr(TaskIdentity, name, value)
    state = (factory := NodeStateFactory(ObjectStoreFactory())).state()
    assert state.store_fab(Fab(hash_str="", content=CONTENT, verifications={})) == DIGEST
    run = dataclasses.replace(Run.create_empty(RUN), fab_id="someone/demo", fab_version="1.0.0", fab_hash=DIGEST)
    state.store_run(dataclasses.replace(run, series_id=3))
    state.set_run_series_context(3, Context(run_id=RUN, node_id=1, node_config={}, state=RecordDict(), run_config={}))
    sent = []

    def task(rows: int = 1024) -> str:
        arrays = {k: Array(np.full((rows, 512), i, dtype=np.float32)) for i, k in enumerate("ab")}
        message = Message(RecordDict({"arrays": ArrayRecord(arrays)}), dst_node_id=1, message_type="train")
        _insert_message(message, state, state.object_store)
        sent.append(message)
        return state.claim_task(state.create_task(TaskType.CLIENT_APP, RUN))

    return TestClient(create_app(factory)), task, sent


def _ask(app: TestClient, token: str, held: list[str]):
    kinds = object_batches.kinds()
    body = kinds["TaskInputRequest"](task=PullTaskInputRequest(), held=[FabProto(hash_str=h) for h in held])
    path = object_batches.RUNTIME + task_input.ROUTE
    answer = app.post(path, content=body.SerializeToString(), headers={**PROTOBUF, TASK_TOKEN_HEADER: token})
    parsed = kinds["TaskInput"]()
    if answer.status_code == 200:
        parsed.ParseFromString(answer.content)
    return answer.status_code, parsed


def test_the_supernode_answers_the_task_whole_and_leaves_out_only_a_fab_the_clientapp_holds(supernode):
    app, task, sent = supernode
    status, answer = _ask(app, task(), [DIGEST])
    assert status == 200 and answer.task.fab.content == b"" and answer.task.fab.hash_str == DIGEST
    assert answer.task.run.fab_id == "someone/demo" and answer.task.context.run_id == RUN  # Flower's answer
    assert answer.messages.message_object_trees[0].object_id == sent[0].object_id
    got = sum(len(o.object_content) for o in answer.objects)  # the first objects, up to the cap
    assert 1 <= len(answer.objects) < 7 and 2_000_000 < got <= object_batches.BATCH_BYTES
    status, answer = _ask(app, task(rows=128), [DIGEST])
    assert len(answer.objects) == 7 and all(o.object_available for o in answer.objects)  # the whole message
    for held in ([], ["0" * 64], [DIGEST[:8] + "0" * 56]):  # not held, another FAB, a prefix's namesake
        status, answer = _ask(app, task(), held)
        assert status == 200 and answer.task.fab.content == CONTENT and answer.task.fab.hash_str == DIGEST
    assert _ask(app, "not-a-token", [DIGEST])[0] in (401, 403)  # the task's token is checked as on Flower's route
    token = task()
    assert _ask(app, token, [DIGEST])[0] == 200
    assert _ask(app, token, [DIGEST])[0] != 200  # a task starts once, as with Flower's pull-task-input


def _flower_pull(app: TestClient, token: str, pins: set[str], monkeypatch) -> tuple[task_input.Puller, tuple, list]:
    """Flower's own ClientApp pull (``run_clientapp.pull_task_input``, with the object batches a
    ClientApp installs) through the ``Puller``; and the paths it called."""
    from flwr.supercore.inflatable import inflatable_protobuf_utils, inflatable_utils

    for name in object_batches.OURS:  # what install_clients keeps of Flower's, and puts in its place
        source = inflatable_protobuf_utils if name.startswith("make_") else inflatable_utils
        monkeypatch.setitem(object_batches.FLOWER, name, getattr(source, name))
    for name in object_batches.CLIENT_MODULES["flwr.supernode.runtime.run_clientapp"]:
        monkeypatch.setattr(run_clientapp, name, object_batches.OURS[name])
    auth = [RuntimeTokenHttpInterceptor(token)]
    client = RuntimeHttpClient.from_server_address("testserver", True, None, interceptors=auth)
    calls, send = [], app.send
    monkeypatch.setattr(app, "send", lambda request, **kw: calls.append(request.url.path) or send(request, **kw))
    client._client = app  # Flower's client, talking to the app in this process
    client.PullTaskInput = puller = task_input.Puller(client, pins)
    return puller, run_clientapp.pull_task_input(client), calls


def test_a_clientapp_gets_its_task_in_one_call_and_names_the_pinned_fabs_installed(supernode, tmp_path, monkeypatch):
    app, task, sent = supernode
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    puller, (message, context, run, fab), calls = _flower_pull(app, task(rows=128), {DIGEST}, monkeypatch)
    assert puller.held == [] and puller.withheld is None and fab.content == CONTENT  # nothing installed yet
    assert message.object_id == sent[-1].object_id and context.node_id == 1 and run.fab_hash == DIGEST
    np.testing.assert_array_equal(message.content["arrays"]["b"].numpy(), np.full((128, 512), 1, dtype=np.float32))
    assert calls == ["/v1/runtime/pull-task", "/v1/runtime/confirm-message-received"]  # Flower: four calls
    _, (message, *_), calls = _flower_pull(app, task(), {DIGEST}, monkeypatch)  # past the cap: the rest pulled
    assert calls == ["/v1/runtime/pull-task", "/v1/runtime/pull-objects", "/v1/runtime/confirm-message-received"]
    np.testing.assert_array_equal(message.content["arrays"]["b"].numpy(), np.full((1024, 512), 1, dtype=np.float32))
    folder = tmp_path / "apps" / f"someone.demo.1.0.0.{DIGEST[:8]}"
    folder.mkdir(parents=True)
    puller, (message, *_, fab), _ = _flower_pull(app, task(), {DIGEST, "ab" * 32}, monkeypatch)
    assert puller.held == [DIGEST] and puller.withheld == DIGEST and fab.content == b""
    assert message.object_id == sent[-1].object_id and task_input.installed("someone/demo", "1.0.0", DIGEST) == folder
    puller, (*_, fab), _ = _flower_pull(app, task(), {"ab" * 32}, monkeypatch)  # the run's FAB is not pinned
    assert puller.withheld is None and fab.content == CONTENT
    folder.rmdir()
    with pytest.raises(task_input.FabWithheld, match="removed"):
        task_input.installed("someone/demo", "1.0.0", DIGEST)


def test_a_supernode_without_the_route_gets_flowers_calls(supernode, tmp_path, monkeypatch):
    app, task, sent = supernode
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    (tmp_path / "apps" / f"someone.demo.1.0.0.{DIGEST[:8]}").mkdir(parents=True)
    router = object_batches.server_parts()[2].router  # Flower's Runtime router, which the app includes
    monkeypatch.setattr(router, "routes", [r for r in router.routes if not r.path.endswith(task_input.ROUTE)])
    puller, (message, *_, fab), calls = _flower_pull(app, task(), {DIGEST}, monkeypatch)
    assert puller.held == [DIGEST] and puller.withheld is None and fab.content == CONTENT
    assert message.object_id == sent[-1].object_id and calls[:3] == [
        f"/v1/runtime/{c}" for c in ("pull-task", "pull-task-input", "pull-messages")
    ]


def test_the_pin_decides_what_runs_when_the_bytes_are_left_out():
    pins = frozenset({DIGEST})
    assert check_task_fab(b"", DIGEST, pins, "someone/demo 1.0.0") == DIGEST  # withheld, pinned
    with pytest.raises(AppNotPinned, match="someone/demo 1.0.0 has sha256 " + "cd" * 32):
        check_task_fab(b"", "cd" * 32, pins, "someone/demo 1.0.0")  # withheld, not pinned
    with pytest.raises(AppNotPinned):
        check_task_fab(b"", None, pins, "someone/demo 1.0.0")  # no bytes and nothing withheld: the empty FAB's digest
    with pytest.raises(AppNotPinned):
        check_task_fab(b"other bytes", DIGEST, pins, "x")  # bytes that came are what is checked
