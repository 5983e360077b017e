"""deploy.object_uploads held to Flower's own SqlCoreState.store_object, item by item: the same answers
and the same rows, through the request state the batched routes hand their handlers."""

from __future__ import annotations

import itertools
import random

import pytest

from fedvlm.deploy import object_uploads
from fedvlm.deploy.object_batches import RequestState

RUN, OTHER_RUN = 1, 2
SESSIONS = [itertools.count()]  # push session ids, counted afresh for each database so that both name them alike


@pytest.fixture(autouse=True)
def _installed(monkeypatch):
    from flwr.supercore.corestate import sql_corestate

    monkeypatch.setattr(sql_corestate.SqlCoreState, "store_objects", object_uploads.store_objects, raising=False)
    monkeypatch.setattr(sql_corestate, "uuid4", lambda: f"session-{next(SESSIONS[0])}")


def _state(path):
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.supercore.object_store.sql_object_store import SqlObjectStore
    from flwr.superlink.federation import NoOpFederationManager

    store = SqlObjectStore(str(path))
    store.initialize()
    state = SqlLinkState(str(path), NoOpFederationManager(), store)
    state.initialize()
    return state


def _messages(rng: random.Random, count: int) -> list:
    """Record dicts as messages carry them, one array shared by all (a shared object)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, RecordDict

    shared = Array(np.arange(4.0))
    arrays = [{f"a{k}": Array(np.full(3, rng.random())) for k in range(3)} for _ in range(count)]
    return [RecordDict({f"r{n}": ArrayRecord({"s": shared, **own})}) for n, own in enumerate(arrays)]


def _rows(state) -> dict[str, list]:
    from sqlalchemy import text

    with state.session() as session:
        return {
            table: sorted(tuple(r) for r in session.execute(text(f"SELECT {cols} FROM {table}")).all())
            for table, cols in (
                ("object_push_sessions", "session_id, run_id, pending_count"),
                ("object_push_session_pending", "session_id, object_id"),
                ("object_push_session_roots", "session_id, root_object_id"),
                ("objects", "object_id, is_available, content, ref_count"),
            )
        }


def _requests(rng: random.Random, uploads: list[tuple[int, str, str, bytes]]) -> list[list]:
    """The uploads in requests of a few items, with what a node may also send: an object again, one
    under the wrong run, content that is not its id's, an id nobody registered."""
    rng.shuffle(uploads)
    requests, at = [], 0
    while at < len(uploads):
        size = rng.randint(1, 6)
        request = list(uploads[at : at + size])
        at += size
        run, session, object_id, content = rng.choice(uploads)
        request.insert(
            rng.randint(0, len(request)),
            rng.choice(
                [
                    (run, session, object_id, content),  # again (or for the first time, if later)
                    (OTHER_RUN, session, object_id, content),
                    (run, session, object_id, content + b"x"),
                    (run, session, "f" * 64, content),
                ]
            ),
        )
        requests.append([item for n, item in enumerate(request) if item[:3] not in {i[:3] for i in request[:n]}])
    return requests


def _setup(state, messages: list, expired: int | None, dropped: int | None) -> list[tuple[int, str, str, bytes]]:
    """Each message in a push session of its own, preregistered; the uploads its tree asks for. The
    ``expired``-th session's life is over; the ``dropped``-th object the first session waits for
    has lost its row."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
    from sqlalchemy import text

    SESSIONS[0] = itertools.count()
    uploads = []
    for n, message in enumerate(messages):
        session = state.start_session(RUN)
        objects = get_all_nested_objects(message)
        missing = state.preregister_object_tree(get_object_tree(message), session)
        uploads += [(RUN, session, i, objects[i].deflate()) for i in missing]
        with state.session() as db:
            if n == expired:
                past = "UPDATE object_push_sessions SET expires_at = '2000-01-01 00:00:00' WHERE session_id = :s"
                db.execute(text(past), {"s": session})
            if n == 0 and dropped is not None:
                db.execute(text("DELETE FROM objects WHERE object_id = :o"), {"o": missing[dropped % len(missing)]})
    return uploads


@pytest.mark.parametrize("seed", range(10))
def test_a_requests_uploads_match_flowers_one_by_one(tmp_path, seed):
    rng = random.Random(seed)
    messages = _messages(rng, rng.randint(1, 4))
    expired = rng.randrange(len(messages)) if seed % 3 == 0 else None
    dropped = rng.randrange(8) if seed % 3 == 1 else None
    flower, batched = _state(tmp_path / "flower.db"), _state(tmp_path / "batched.db")
    uploads = _setup(flower, messages, expired, dropped)
    assert _setup(batched, messages, expired, dropped) == uploads
    assert _rows(flower) == _rows(batched)
    stored = 0
    for request in _requests(rng, list(uploads)):
        expected = [flower.store_object(*item) for item in request]
        state = RequestState(batched, request)  # a handler reads each content afresh from its protobuf item
        assert [state.store_object(r, s, i, bytes(bytearray(c))) for r, s, i, c in request] == expected, request
        assert _rows(flower) == _rows(batched)
        stored += sum(expected)
    if expired is None:  # every upload is sent: all but the one without a row are stored
        assert stored == len(uploads) - (dropped is not None)


def test_a_batch_is_one_claim_and_one_write(tmp_path):
    """The point of it: a session's objects in a handful of statements, not a handful each."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    state = _state(tmp_path / "batched.db")
    uploads = _setup(state, _messages(random.Random(0), 1), None, None)
    statements = []

    def count(*_):
        statements.append(1)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        answers = state.store_objects(RUN, uploads[0][1], [(i, c) for _, _, i, c in uploads])
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    assert answers == [True] * len(uploads) and len(uploads) >= 5
    assert len(statements) <= 7, len(statements)


def test_the_superlinks_batched_routes_store_a_request_at_once(tmp_path):
    """Wired where it counts: Flower's SuperLink app with the deployment's patches, a round's pushes
    through its push-objects and push-message routes (bench.superlink_requests, its own process so
    that the patches stay out of this one)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "requests.json"
    command = [sys.executable, "-m", "bench.superlink_requests", "--nodes", "3", "--rounds", "1", "--warm", "1"]
    subprocess.run([*command, "--repeats", "1", "--out", str(out)], check=True, capture_output=True, timeout=300)
    kinds = json.loads(out.read_text())["runs"][0]["requests"]
    # Flower's store_object item by item: 258 statements for 20 nodes' instructions, 50 for a reply
    assert kinds["runtime/push-objects"]["sql_statements_mean"] <= 8
    assert kinds["fleet/push-message"]["sql_statements_mean"] <= 36
