"""The SuperNode's gate (deploy.supernode_gate) around Flower's own message pull, with Flower's
real node state and object store: a run of an unpinned app, or any AgentApp run, is answered
with an error reply and leaves nothing behind (no run, no FAB, no task); a pinned ClientApp run
goes through as Flower would take it."""

from __future__ import annotations

import hashlib
import io
import types
import zipfile

import flwr.supernode.start_client_internal as loop
import pytest
from flwr.app import Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.constant import TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supernode.nodestate import NodeStateFactory

from fedvlm.deploy import supernode_gate
from fedvlm.deploy.supernode_gate import GateUnavailable, check_flower, gate


def _fab() -> bytes:
    """A minimal FAB (a zip with the app's pyproject.toml) for the release the node reviewed."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr(
            "pyproject.toml",
            '[project]\nname = "app"\nversion = "1.0"\n\n[tool.flwr.app]\npublisher = "org"\n\n'
            '[tool.flwr.app.components]\nclientapp = "app:client"\nserverapp = "app:server"\n\n'
            "[tool.flwr.app.config]\nx = 1\n",
        )
    return out.getvalue()


PINNED = _fab()
PIN = hashlib.sha256(PINNED).hexdigest()
RUN_ID, NODE_ID = 42, 7


def _node():
    stores = ObjectStoreFactory()
    state, store = NodeStateFactory(stores).state(), stores.store()
    state.set_node_id(NODE_ID)
    return state, store


def _message() -> Message:
    msg = Message(RecordDict(), dst_node_id=NODE_ID, message_type="train")
    msg.metadata.__dict__["_run_id"] = RUN_ID
    msg.metadata.__dict__["_src_node_id"] = 1
    msg.metadata.__dict__["_message_id"] = msg.object_id
    return msg


def _pull(fab: bytes, task_type: str):
    """One call of the gated pull; (state, the FAB hashes fetched, the message)."""
    state, store = _node()
    msg, fetched = _message(), []
    objects = get_all_nested_objects(msg)  # what the SuperLink would serve
    run = Run.create_empty(RUN_ID)
    run.fab_hash, run.fab_id, run.fab_version = hashlib.sha256(fab).hexdigest(), "someone/app", "1.0"
    run.primary_task_type = task_type

    def get_fab(fab_hash: str, run_id: int) -> Fab:
        fetched.append(fab_hash)
        return Fab(fab_hash, fab, {})

    pulled = gate(loop._pull_and_store_message, frozenset({PIN}), loop._insert_message)(
        state=state,
        object_store=store,
        node_config={},
        receive=lambda: (msg, get_object_tree(msg)),
        get_run=lambda run_id: run,
        get_fab=get_fab,
        pull_object=lambda run_id, object_id: objects[object_id].deflate(),
        confirm_message_received=lambda run_id, message_id: None,
        trusted_entities=None,
    )
    assert pulled == RUN_ID
    return state, fetched, msg


def _refusal(state, msg) -> str:
    (reply,) = state.get_messages_legacy(is_reply=True)
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id
    assert reply.error.code == ErrorCode.INVALID_FAB
    return reply.error.reason


def test_an_unpinned_app_is_refused_before_anything_of_it_is_stored():
    state, fetched, msg = _pull(b"an outsider's app", TaskType.SERVER_APP)
    reason = _refusal(state, msg)
    assert (
        reason.startswith("AppNotPinned:")
        and PIN in reason
        and hashlib.sha256(b"an outsider's app").hexdigest() in reason
    )
    assert state.get_run(RUN_ID) is None and state.get_tasks() == []  # nothing stored, nothing to start


def test_an_agentapp_run_is_refused_before_its_app_is_fetched():
    state, fetched, msg = _pull(PINNED, TaskType.AGENT_APP)  # even the pinned app, as an AgentApp
    assert _refusal(state, msg).startswith("NotAClientApp:") and fetched == []
    assert state.get_run(RUN_ID) is None and state.get_tasks() == []


def test_a_pinned_clientapp_run_goes_through_as_flower_takes_it():
    state, fetched, msg = _pull(PINNED, TaskType.SERVER_APP)
    assert fetched == [PIN] and state.get_run(RUN_ID) is not None
    (task,) = state.get_tasks()
    assert task.type == TaskType.CLIENT_APP and not state.get_messages_legacy(is_reply=True)


def test_a_flower_it_does_not_know_stops_the_node_instead_of_running_unguarded(monkeypatch):
    assert check_flower(loop) is None  # the installed Flower: revisit supernode_gate when this fails
    other = types.ModuleType("other_flower")
    assert "no _pull_and_store_message" in (check_flower(other) or "")
    monkeypatch.setattr(supernode_gate, "check_flower", lambda module: "a different loop")
    with pytest.raises(GateUnavailable, match="refusing to start a SuperNode that would run any app"):
        supernode_gate.install([PIN])
