"""Two database costs the SuperLink paid on every request, paid when what they read changes.

Flower 1.42's SuperLink with SQLite state (as docs/deployment.md deploys it), per request:

- the Fleet API's node authentication looks the calling node up by its public key
  (``SqlLinkState.get_node_id_by_public_key``, a transaction), although a key's node changes only
  when a node is registered or unregistered: here the answer is kept per database and key, and
  forgotten whenever this SuperLink creates or deletes a node (``create_node``, ``delete_node``,
  which unregistering calls). Only found nodes are kept, so unknown keys cannot grow it; the
  signature of every request is still checked, by Flower, every time;
- every runtime request that shows a task token first sweeps all expired tokens
  (``SqlCoreState._cleanup_expired_task_tokens``, two UPDATE statements): here it sweeps at most
  once per ``every`` seconds (default 1) per database. A token whose task stopped sending
  heartbeats is refused at most that long after its window ended (Flower's window: 30 s).

What is refused stays refused: an unregistered node's key is forgotten in the same call that
unregisters it. The state is this process's: a second SuperLink writing the same database is not
a deployment this project makes. CPU seconds per program before and after: docs/results/deployment.md.

The guard (``check_flower``) finds the four methods on Flower's SQL states; a Flower that reads
otherwise gets no change, with a warning (every request pays both again, nothing else).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from fedvlm.deploy.flower_patches import lacking

log = logging.getLogger("fedvlm.deploy")

SWEEP_EVERY_S = 1.0


def _states():
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.supercore.corestate.sql_corestate import SqlCoreState

    return SqlLinkState, SqlCoreState


def check_flower() -> str | None:
    """Why the installed Flower's lookups are not the ones this keeps (None: they are)."""
    try:
        link, core = _states()
    except ImportError as err:
        return f"it does not have {err.name}"
    why = lacking(link, "get_node_id_by_public_key", "create_node", "delete_node")
    why = why or lacking(core, "_cleanup_expired_task_tokens")
    return why or (None if issubclass(link, core) else "SqlLinkState is no longer a SqlCoreState")


def _database(state) -> str:
    """The database a state writes: its URL, or the state itself for an in-memory SQLite (its own)."""
    url = str(getattr(state, "database_url", ""))
    return f"{url}#{id(state)}" if getattr(state, "_is_in_memory_sqlite", False) else url


class NodeKeys:
    """Found nodes by (database, public key); emptied by every change to the nodes."""

    def __init__(self) -> None:
        self.found: dict[tuple[str, bytes], int] = {}
        self.lock = threading.Lock()

    def lookup(self, find: Callable) -> Callable:
        @functools.wraps(find)
        def get_node_id_by_public_key(state, public_key: bytes) -> int | None:
            key = (_database(state), bytes(public_key))
            with self.lock:
                if key in self.found:
                    return self.found[key]
            node_id = find(state, public_key)
            if node_id is not None:
                with self.lock:
                    self.found[key] = node_id
            return node_id

        return get_node_id_by_public_key

    def forgetting(self, change: Callable) -> Callable:
        @functools.wraps(change)
        def changed(state, *args, **kwargs):
            try:
                return change(state, *args, **kwargs)
            finally:
                with self.lock:
                    self.found.clear()

        return changed


def swept_at_most_every(every: float, sweep: Callable) -> Callable:
    last: dict[str, float] = {}  # database -> when it was last swept
    lock = threading.Lock()

    @functools.wraps(sweep)
    def _cleanup_expired_task_tokens(state) -> None:
        database, now = _database(state), time.monotonic()
        with lock:
            if now - last.get(database, -every) < every:
                return
            last[database] = now
        sweep(state)

    return _cleanup_expired_task_tokens


def install(every: float = SWEEP_EVERY_S) -> bool:
    """Keep node lookups and pace token sweeps in this process's SuperLink; False, with a warning,
    when Flower's SQL state is not the one this was written for."""
    from fedvlm.deploy import flower_patches

    if not flower_patches.applies("link-lookups"):
        return False
    link, core = _states()
    keys = NodeKeys()
    link.get_node_id_by_public_key = keys.lookup(link.get_node_id_by_public_key)
    link.create_node = keys.forgetting(link.create_node)
    link.delete_node = keys.forgetting(link.delete_node)
    core._cleanup_expired_task_tokens = swept_at_most_every(every, core._cleanup_expired_task_tokens)
    return True
