"""A request's uploaded objects stored in one transaction, not one each.

Flower 1.42's ``SqlCoreState.store_object`` stores one uploaded object (a push-object item) in a
transaction of its own: it claims the object's pending row of its push session, reads the session's
expiry, writes the content and counts the session down, five statements or so an object. A
SuperNode's reply with its objects (``deploy.whole_messages``' push-message) and the ServerApp's
push-objects (``deploy.object_batches``) hand it a request's objects one at a time: 258 statements
for a 20-node round's instructions (docs/results/deployment.md, 'A message's objects in set
statements').

``store_objects`` is ``store_object`` for several objects of one push session and run, in order,
in one transaction: one claim of their pending rows, one read of the expiry, one write of the
contents (an executemany), one read of which objects are stored, one count-down. Each object's
answer is the one Flower's ``store_object`` gives it called item by item:

- an object that is not pending in this session of this run (pushed before, another session's,
  the wrong run): False, nothing changes;
- content whose id or form the object store refuses (its ``verify``): False, its pending row kept
  (Flower's put raises after the claim and the expiry check, and rolls the claim back);
- a session past its expiry: False for all, the session and its messages cleaned up as Flower does;
- a claimed object whose row the object store no longer holds: False, its pending row put back
  (Flower's rollback); one already uploaded by another session: True, its content left;
- the session's count reaching zero: the session's bookkeeping removed, as Flower does after the
  last object.

The claim takes SQLite's write lock, so nothing else writes between these statements, as nothing
does inside Flower's one-object transaction. Anything that fails inside rolls the whole batch back
and answers each object with Flower's own ``store_object``: no object is ever answered from a
half-done batch. ``tests/unit/test_object_uploads.py`` holds it to Flower's method item by item on a
second database: the same answers and the same rows in the sessions', pending and objects' tables.

Why nothing else changes: the objects stored, their sessions' counts and their cleanup are
Flower's; a batch only ever holds contiguous items of one session and run that Flower's handler
would have stored one after another with the same checks passed (``object_batches.RequestState``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fedvlm.deploy.flower_patches import lacking


def store_objects(self, run_id: int, session_id: str, contents: list[tuple[str, bytes]]) -> list[bool]:
    """Flower's ``store_object(run_id, session_id, id, content)`` for each of ``contents`` (distinct
    ids, one session), in one transaction."""
    shared = getattr(self.object_store, "_session_scope", None) == getattr(self, "_session_scope", ())
    if session_id and shared:  # else a legacy node's objects (Flower finds each one's session), or objects elsewhere
        try:
            stored = _store(self, run_id, session_id, dict(contents))
            return [i in stored for i, _ in contents]
        except Exception:  # noqa: BLE001 - rolled back: Flower's own call answers each, and logs its failure
            pass
    return [self.store_object(run_id, session_id, i, c) for i, c in contents]  # Flower's own call answers each


def _verified(store: Any, object_id: str, content: bytes) -> bool:
    """Whether the object store's ``put`` takes this content (its id and form, where it verifies)."""
    from flwr.supercore.inflatable.inflatable_object import get_object_id
    from flwr.supercore.inflatable.inflatable_utils import validate_object_content

    if not getattr(store, "verify", False):
        return True
    try:
        validate_object_content(content=content)
    except Exception:  # noqa: BLE001 - Flower's put raises whatever the validation raises; store_object says False
        return False
    return get_object_id(content) == object_id


def _store(self, run_id: int, session_id: str, contents: dict[str, bytes]) -> set[str]:
    """The ids stored: claimed, within the session's life, content the object store takes, and held
    by it. As in Flower, content it refuses is claimed first (so an expired session is cleaned up)."""
    from flwr.supercore.corestate import sql_corestate as core
    from sqlalchemy import insert, select

    with self.session() as session:
        claimed = _claim(session, run_id, session_id, list(contents))
        if not claimed:
            return set()
        pushed = core.ObjectPushSessionModel
        expires_at = session.scalar(
            select(pushed.expires_at).where(pushed.session_id == session_id).execution_options(populate_existing=True)
        )
        if expires_at <= core.now():
            self._cleanup_push_session(session_id, cleanup_messages=True)
            return set()
        taken = {i: contents[i] for i in claimed if _verified(self.object_store, i, contents[i])}
        stored = _put(session, taken) if taken else set()
        if lost := claimed - stored:  # Flower's put raised for these, and its rollback kept their rows
            rows = [{"session_id": session_id, "object_id": i} for i in sorted(lost)]
            session.execute(insert(core.ObjectPushSessionPendingModel), rows)
        if stored and _count_down(session, session_id, len(stored), core) == 0:
            self._cleanup_push_session(session_id, cleanup_messages=False)
        return stored


def _claim(session, run_id: int, session_id: str, ids: list[str]) -> set[str]:
    """Flower's ``_claim_pending_object`` for every id at once: the pending rows of this session, in
    this run, deleted; their ids."""
    from flwr.supercore.corestate import sql_corestate as core
    from sqlalchemy import delete, select

    pending, pushed = core.ObjectPushSessionPendingModel, core.ObjectPushSessionModel
    owned = (
        select(pushed.session_id)
        .where(pushed.session_id == session_id, pushed.run_id == core.uint64_to_int64(run_id))
        .exists()
    )
    claim = (
        delete(pending)
        .where(pending.session_id == session_id, pending.object_id.in_(ids), owned)
        .returning(pending.object_id)
    )
    return set(session.scalars(claim))


def _put(session, contents: dict[str, bytes]) -> set[str]:
    """Flower's ``SqlObjectStore.put`` for each: content written where the row waits for it; the ids
    whose row is there (written now or uploaded before)."""
    from sqlalchemy import bindparam, text

    write = text("UPDATE objects SET content = :c, is_available = 1 WHERE object_id = :i AND is_available = 0")
    session.execute(write, [{"i": i, "c": c} for i, c in contents.items()])
    held = text("SELECT object_id FROM objects WHERE object_id IN :ids")
    return set(session.scalars(held.bindparams(bindparam("ids", expanding=True)), {"ids": list(contents)}))


def _count_down(session, session_id: str, stored: int, core: Any) -> int:
    """The session's pending count less ``stored``, its expiry renewed (Flower's per-object update)."""
    from sqlalchemy import update

    pushed = core.ObjectPushSessionModel
    renewed = core.now() + timedelta(seconds=core.OBJECT_PUSH_SESSION_TTL_SECONDS)
    left = session.scalar(
        update(pushed)
        .where(pushed.session_id == session_id)
        .values(pending_count=pushed.pending_count - stored, expires_at=renewed)
        .returning(pushed.pending_count)
    )
    if left is None:
        raise RuntimeError("Object push session disappeared after claim")
    return int(left)


def check_flower(module: Any) -> str | None:
    """Why the installed Flower's SQL core state is not the one this batches (None: it is): the
    methods and names ``_store`` calls, the session tables' columns, and a ``store_object`` that still
    claims, checks the expiry, puts and counts down in that order."""
    import inspect

    from flwr.supercore.state.schema.corestate_tables import create_corestate_metadata

    names = ("store_object", "_cleanup_push_session", "session")
    if why := lacking(module.SqlCoreState, *names):
        return why
    wanted = (
        "ObjectPushSessionModel",
        "ObjectPushSessionPendingModel",
        "now",
        "uint64_to_int64",
        "OBJECT_PUSH_SESSION_TTL_SECONDS",
    )
    if missing := [n for n in wanted if not hasattr(module, n)]:
        return f"sql_corestate no longer has {', '.join(missing)}"
    tables = create_corestate_metadata().tables
    for table, columns in TABLES.items():
        if table not in tables or not columns <= {c.name for c in tables[table].columns}:
            return f"its core state has no table {table} with columns {', '.join(sorted(columns))}"
    source = " ".join(inspect.getsource(module.SqlCoreState.store_object).split())
    steps = ("self._claim_pending_object(", "if expires_at <= now():", "self.object_store.put(", "pending_count - 1")
    if any(step not in source for step in steps) or sorted(steps, key=source.index) != list(steps):
        return "SqlCoreState.store_object no longer claims, checks the expiry, puts and counts down in that order"
    return None


# Flower's push-session tables and the columns these statements name
TABLES = {
    "object_push_sessions": {"session_id", "run_id", "expires_at", "pending_count"},
    "object_push_session_pending": {"session_id", "object_id"},
}


def install() -> bool:
    """Give Flower's ``SqlCoreState`` ``store_objects`` (before a state is built); False, with a
    warning, where its core state is not the one this was written for."""
    from flwr.supercore.corestate import sql_corestate

    from fedvlm.deploy import flower_patches

    if not flower_patches.applies("object-uploads"):
        return False
    sql_corestate.SqlCoreState.store_objects = store_objects  # type: ignore[attr-defined]
    return True
