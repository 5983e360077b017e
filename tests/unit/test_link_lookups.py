"""The SuperLink's per-request lookups (``deploy.link_lookups``) on Flower's own SQLite state: a
node's key is read from the database once, and an unregistered node is refused at once; expired
task tokens are swept at most once a second, and still swept."""

from __future__ import annotations

import time

import pytest

from fedvlm.deploy import link_lookups


@pytest.fixture
def installed(monkeypatch):
    link, core = link_lookups._states()
    for cls, name in ((link, "get_node_id_by_public_key"), (link, "create_node"), (link, "delete_node")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # undone after the test
    monkeypatch.setattr(core, "_cleanup_expired_task_tokens", core._cleanup_expired_task_tokens)
    assert link_lookups.check_flower() is None
    assert link_lookups.install(every=0.5)


def _state(tmp_path):
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager

    return LinkStateFactory(str(tmp_path / "state.db"), NoOpFederationManager(), ObjectStoreFactory()).state()


def _statements(state) -> list[str]:
    from sqlalchemy import event

    seen: list[str] = []
    event.listen(state._engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    return seen


def test_a_node_is_looked_up_once_and_refused_as_soon_as_it_is_unregistered(installed, tmp_path):
    state = _state(tmp_path)
    node = state.create_node("owner", "name", b"key-1", 30.0)
    assert state.get_node_id_by_public_key(b"key-1") == node  # read from the database
    seen = _statements(state)
    assert all(state.get_node_id_by_public_key(b"key-1") == node for _ in range(5))
    assert seen == []  # kept: no statement for a known key
    assert state.get_node_id_by_public_key(b"key-2") is None and len(seen) == 1  # not kept
    state.delete_node("owner", node)
    assert state.get_node_id_by_public_key(b"key-1") is None  # unregistered: forgotten at once
    other = state.create_node("owner", "name", b"key-2", 30.0)  # a node registered after a lookup missed
    assert state.get_node_id_by_public_key(b"key-2") == other != node


def test_expired_tokens_are_swept_at_most_every_interval(installed, tmp_path):
    state = _state(tmp_path)
    state._engine  # noqa: B018 - made on first use
    state.get_node_id_by_public_key(b"warm")  # the engine exists
    seen = _statements(state)
    for _ in range(10):
        state._cleanup_expired_task_tokens()
    sweeps = len(seen)
    assert sweeps > 0  # the first call swept
    state._cleanup_expired_task_tokens()
    assert len(seen) == sweeps  # within the interval: not again
    time.sleep(0.6)
    state._cleanup_expired_task_tokens()
    assert len(seen) > sweeps  # after it: swept again
