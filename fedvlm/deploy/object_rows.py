"""Flower's SQL object store, a message's rows read and removed in a few statements, not a few per object.

Flower 1.42's ``SqlObjectStore`` (the SuperLink's objects with ``--database FILE``, as
docs/deployment.md deploys it) walks a message's object tree one object at a time:
``get_object_tree`` reads two rows per object (its existence and its links), recursively, and
``delete`` (every confirmation of a message) opens a recursion per object with four statements each.
A 20-node PromptFL round runs 4,230 SQL statements in the SuperLink, about 0.3 ms of CPU each
(``bench/superlink_requests.py``; docs/results/deployment.md, 'A SuperLink request's CPU, by kind').

Here the same two methods work on sets:

- ``get_object_tree``: one recursive query lists the objects under the root with whether each is
  stored, one reads their links; the tree is built in Python, each object's children in the order
  Flower's per-object query returns them (the links' primary key, ``(parent_id, child_id)``: by
  child id). A root that is not stored and a tree with a missing object raise Flower's errors with
  Flower's words.
- ``delete``: one recursive query reads the reference counts of the objects under the root, one
  their links; the cascade is worked out in Python (a deleted object takes one reference from each
  child, never below zero, as Flower's ``ref_count > 0`` guard keeps it; a child left with none is
  deleted in turn), then one statement deletes and one sets the counts that changed. Flower recurses
  one object at a time; the rows left are the same, since an object is deleted once no reference
  to it is left, whatever the order its parents went in.

Why nothing else changes: both run in the same session and under the same mutation lock as Flower's
(``_mutation_session``), so a concurrent ``preregister`` waits for them as it waits for Flower's.
``tests/unit/test_object_rows.py`` holds each to Flower's own method on the same database: random
object graphs (shared subtrees, objects under two parents, missing objects), the same answers, the
same errors and the same rows after every delete.
"""

from __future__ import annotations

from typing import Any

from fedvlm.deploy.flower_patches import lacking

# the objects under a root (the root too), through the links
_UNDER_ROOT = """
WITH RECURSIVE under(id) AS (
    SELECT :root UNION SELECT c.child_id FROM object_children c JOIN under u ON c.parent_id = u.id
)
"""
_UNDER = (
    _UNDER_ROOT
    + """SELECT u.id, o.object_id IS NOT NULL FROM under u LEFT JOIN objects o ON o.object_id = u.id
"""
)
_LINKS = (
    _UNDER_ROOT
    + """SELECT c.parent_id, c.child_id FROM object_children c JOIN under u ON c.parent_id = u.id
"""
)


def _links(session, root: str) -> dict[str, list[str]]:
    """Each object under ``root`` and the children it links to."""
    from sqlalchemy import text

    children: dict[str, list[str]] = {}
    for parent, child in session.execute(text(_LINKS), {"root": root}).all():
        children.setdefault(parent, []).append(child)
    return children


def get_object_tree(self, object_id: str):
    """Flower's ``SqlObjectStore.get_object_tree``, in two statements."""
    from flwr.proto.message_pb2 import ObjectTree
    from flwr.supercore.object_store.object_store import NoObjectInStoreError
    from sqlalchemy import text

    with self.session() as session:
        stored = dict(session.execute(text(_UNDER), {"root": object_id}).all())
        if not stored.get(object_id):
            raise NoObjectInStoreError(f"Object {object_id} was not pre-registered.")
        if not all(stored.values()):
            raise NoObjectInStoreError(
                f"Object tree for object ID '{object_id}' contains missing "
                "children. This may indicate a corrupted object store."
            )
        children = _links(session, object_id)

    def tree(node: str) -> Any:
        return ObjectTree(object_id=node, children=[tree(c) for c in sorted(children.get(node, ()))])

    return tree(object_id)


_COUNTS = (
    _UNDER_ROOT
    + """SELECT o.object_id, o.ref_count FROM objects o JOIN under u ON o.object_id = u.id
"""
)


def delete(self, object_id: str) -> None:
    """Flower's ``SqlObjectStore.delete``: the object and every descendant left without a
    reference, worked out from one read of the subtree's counts and links, then written in two
    statements (the deletions; the counts that changed)."""
    from sqlalchemy import bindparam, text

    with self._mutation_session() as session:
        counts = dict(session.execute(text(_COUNTS), {"root": object_id}).all())
        if counts.get(object_id, 1) != 0:
            return
        children = _links(session, object_id)
        gone, todo, changed = [object_id], [object_id], set()
        while todo:  # a deleted object takes one reference from each child, never below zero
            for child in children.get(todo.pop(), ()):
                if counts.get(child, 0) > 0:
                    counts[child] -= 1
                    changed.add(child)
                if counts.get(child) == 0 and child not in gone:  # Flower then deletes any child at zero
                    gone.append(child)
                    todo.append(child)
        session.execute(
            text("DELETE FROM objects WHERE object_id IN :gone").bindparams(bindparam("gone", expanding=True)),
            {"gone": gone},
        )
        kept = [{"o": c, "n": counts[c]} for c in changed if c not in set(gone)]
        if kept:
            session.execute(text("UPDATE objects SET ref_count = :n WHERE object_id = :o"), kept)


def preregister(self, run_id: int, object_tree) -> list[str]:
    """Flower's ``SqlObjectStore.preregister``: the same answer (the tree's objects not yet
    uploaded, in its post-order, repeats kept), the same errors, the same rows, from one read of the
    objects the tree names and four writes (the new objects with their final reference counts, the
    counts of objects already stored, the new objects' links, the run's objects)."""
    from flwr.supercore.inflatable.inflatable_object import is_valid_sha256_hash, iterate_object_tree
    from flwr.supercore.utils import uint64_to_int64
    from sqlalchemy import text

    nodes = list(iterate_object_tree(object_tree))
    for node in nodes:
        if not is_valid_sha256_hash(node.object_id):
            raise ValueError(f"Invalid object ID format: {node.object_id}")
    with self._mutation_session() as session:
        stored, links = _stored(session, list(dict.fromkeys(n.object_id for n in nodes)))
        answer, new, added = _walk(nodes, stored, links)
        rows = [{"o": o, "n": added.pop(o, 0)} for o in new]
        if rows:
            session.execute(
                text("INSERT INTO objects (object_id, content, is_available, ref_count) VALUES (:o, x'', 0, :n)"), rows
            )
        edges = [{"p": o, "c": c} for o in new for c in new[o]]
        if edges:
            session.execute(text("INSERT INTO object_children (parent_id, child_id) VALUES (:p, :c)"), edges)
        if added:
            session.execute(
                text("UPDATE objects SET ref_count = ref_count + :n WHERE object_id = :o"),
                [{"o": o, "n": n} for o, n in added.items()],
            )
        session.execute(
            text("INSERT INTO run_objects (run_id, object_id) VALUES (:r, :o) ON CONFLICT DO NOTHING"),
            [{"r": uint64_to_int64(run_id), "o": o} for o in dict.fromkeys(n.object_id for n in nodes)],
        )
    return answer


def _stored(session, ids: list[str]) -> tuple[dict[str, int], dict[str, set[str]]]:
    """Of ``ids``, those stored (with whether each is available) and their links."""
    from sqlalchemy import bindparam, text

    stored: dict[str, int] = {}
    links: dict[str, set[str]] = {}
    for i in range(0, len(ids), 500):  # SQLite's bound on a statement's variables
        part = {"ids": ids[i : i + 500]}
        rows = text("SELECT object_id, is_available FROM objects WHERE object_id IN :ids")
        stored.update(session.execute(rows.bindparams(bindparam("ids", expanding=True)), part).all())
        edges = text("SELECT parent_id, child_id FROM object_children WHERE parent_id IN :ids")
        for parent, child in session.execute(edges.bindparams(bindparam("ids", expanding=True)), part).all():
            links.setdefault(parent, set()).add(child)
    return stored, links


def _walk(nodes: list, stored: dict[str, int], links: dict[str, set[str]]):
    """Flower's loop over the tree, on what is stored: the answer, the objects it inserts (with their
    children) and the references each child gains, raising where Flower's loop raises."""
    answer: list[str] = []
    new: dict[str, list[str]] = {}
    added: dict[str, int] = {}
    for node in nodes:
        obj, child_ids = node.object_id, [c.object_id for c in node.children]
        if len(child_ids) != len(set(child_ids)):
            raise ValueError(f"Object {obj} has duplicate children.")
        if obj not in stored and obj not in new:
            answer.append(obj)
            new[obj] = child_ids
            for child in child_ids:
                if child in stored or child in new:  # Flower's update finds the row only then
                    added[child] = added.get(child, 0) + 1
            continue
        if stored.get(obj, 0) == 0:  # stored but not uploaded, or inserted by this call
            answer.append(obj)
        if (set(new[obj]) if obj in new else links.get(obj, set())) != set(child_ids):
            raise ValueError(f"Object {obj} was preregistered with different children.")
    return answer, new, added


# Flower's object-store tables and the columns these statements name
TABLES = {
    "objects": {"object_id", "content", "is_available", "ref_count"},
    "object_children": {"parent_id", "child_id"},
    "run_objects": {"run_id", "object_id"},
}


def check_flower(module: Any) -> str | None:
    """Why the installed Flower's SQL object store is not the one this changes (None: it is): its
    three methods, its tables with these columns, and a post-order walk of a tree (the order
    ``preregister`` answers in and counts references by)."""
    import inspect

    from flwr.supercore.inflatable import inflatable_object
    from flwr.supercore.state.schema.objectstore_tables import create_objectstore_metadata

    names = ("get_object_tree", "delete", "preregister", "_mutation_session", "session")
    if why := lacking(module.SqlObjectStore, *names):
        return why
    tables = create_objectstore_metadata().tables
    for table, columns in TABLES.items():
        if table not in tables or not columns <= {c.name for c in tables[table].columns}:
            return f"its object store has no table {table} with columns {', '.join(sorted(columns))}"
    walk = " ".join(inspect.getsource(inflatable_object.iterate_object_tree).split())
    if "yield from iterate_object_tree(child) yield tree" not in walk:
        return "iterate_object_tree no longer walks a tree children first"
    return None


def install() -> bool:
    """Put the three methods in Flower's ``SqlObjectStore`` (before a state is built); False, with a
    warning, where its object store is not the one these were written for."""
    from flwr.supercore.object_store import sql_object_store

    from fedvlm.deploy import flower_patches

    if not flower_patches.applies("object-rows"):
        return False
    store = sql_object_store.SqlObjectStore
    store.get_object_tree, store.delete, store.preregister = get_object_tree, delete, preregister  # type: ignore[method-assign]
    return True
