"""deploy.object_rows held to Flower's own SqlObjectStore: the same trees, errors and rows."""

from __future__ import annotations

import hashlib
import random

import pytest

from fedvlm.deploy import object_rows


def _store(path):
    from flwr.supercore.object_store.sql_object_store import SqlObjectStore

    store = SqlObjectStore(str(path))
    store.initialize()
    return store


def _graph(rng: random.Random, size: int) -> dict[str, list[str]]:
    """A random object graph as messages make them: ids are hashes, an object's children come after
    it, and an object may sit under several parents (a shared array, a shared chunk)."""
    ids = [hashlib.sha256(f"{rng.random()}".encode()).hexdigest() for _ in range(size)]
    return {o: rng.sample(ids[i + 1 :], min(len(ids) - i - 1, rng.randint(0, 3))) for i, o in enumerate(ids)}


def _tree(graph: dict[str, list[str]], node: str):
    from flwr.proto.message_pb2 import ObjectTree

    return ObjectTree(object_id=node, children=[_tree(graph, c) for c in graph[node]])


def _pushed_again(rng: random.Random, graph: dict[str, list[str]], roots: list[str]) -> list:
    """Trees a later push may send: a message again, one under a new parent, a known object with
    other children, a repeated child, an id that is no hash."""
    from flwr.proto.message_pb2 import ObjectTree

    known = list(graph)
    parent = hashlib.sha256(f"{rng.random()}".encode()).hexdigest()
    other = rng.choice(known)
    return [
        _tree(graph, rng.choice(roots)),
        ObjectTree(object_id=parent, children=[_tree(graph, o) for o in rng.sample(known, min(2, len(known)))]),
        ObjectTree(
            object_id=other, children=[_tree(graph, o) for o in known if o != other and o not in graph[other]][:1]
        ),
        ObjectTree(object_id=parent, children=[_tree(graph, known[-1])] * 2),
        ObjectTree(object_id="not-a-hash"),
    ]


def _rows(store) -> dict[str, list]:
    from sqlalchemy import text

    with store.session() as session:
        return {
            table: sorted(tuple(r) for r in session.execute(text(f"SELECT {cols} FROM {table}")).all())
            for table, cols in (
                ("objects", "object_id, ref_count, is_available"),
                ("object_children", "parent_id, child_id"),
                ("run_objects", "run_id, object_id"),
            )
        }


def _answer(call, *args):
    try:
        return call(*args)
    except Exception as err:  # noqa: BLE001 - the error is the answer compared
        return type(err).__name__, str(err)


@pytest.mark.parametrize("seed", range(12))
def test_trees_and_deletes_match_flowers_on_random_graphs(tmp_path, seed):
    from flwr.supercore.object_store.sql_object_store import SqlObjectStore
    from sqlalchemy import text

    rng = random.Random(seed)
    graph = _graph(rng, rng.randint(2, 14))
    roots = rng.sample(list(graph), rng.randint(1, min(4, len(graph))))
    flower, ours = _store(tmp_path / "flower.db"), _store(tmp_path / "ours.db")
    for i, root in enumerate(roots):  # each message registered the way each store registers it
        tree = _tree(graph, root)
        assert _answer(object_rows.preregister, ours, 1 + i % 2, tree) == _answer(
            SqlObjectStore.preregister, flower, 1 + i % 2, tree
        )
    uploaded = rng.sample(list(graph), len(graph) // 3)
    for store in (flower, ours):  # some objects' contents arrived
        with store.session() as session:
            for o in uploaded:
                session.execute(text("UPDATE objects SET is_available = 1 WHERE object_id = :o"), {"o": o})
    for tree in _pushed_again(rng, graph, roots):
        assert _answer(object_rows.preregister, ours, 3, tree) == _answer(SqlObjectStore.preregister, flower, 3, tree)
        assert _rows(ours) == _rows(flower)
    if seed % 5 == 4:  # an object gone from under its links: the corrupted store Flower's error names
        gone = rng.choice(list(graph))
        for store in (flower, ours):
            with store.session() as session:
                session.execute(text("PRAGMA foreign_keys = OFF"))
                session.execute(text("DELETE FROM objects WHERE object_id = :o"), {"o": gone})
    assert _rows(ours) == _rows(flower)
    for node in [*graph, "f" * 64]:
        assert _answer(object_rows.get_object_tree, ours, node) == _answer(SqlObjectStore.get_object_tree, flower, node)
    for root in rng.sample(roots, len(roots)) + rng.sample(list(graph), min(3, len(graph))):
        SqlObjectStore.delete(flower, root)
        object_rows.delete(ours, root)
        assert _rows(ours) == _rows(flower), f"after deleting {root[:8]}"


def test_the_guard_finds_flowers_object_store_and_refuses_another():
    from flwr.supercore.object_store import sql_object_store

    assert object_rows.check_flower(sql_object_store) is None

    class Other:
        SqlObjectStore = type("SqlObjectStore", (), {})

    assert "has no get_object_tree, delete, preregister" in str(object_rows.check_flower(Other))
