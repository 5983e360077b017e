"""A ServerApp's time to start, and a bound on how often it is started, in Flower's SuperLink.

Flower 1.42's SuperLink hands a task to a SuperExec with a token that lives 30 s
(``HEARTBEAT_DEFAULT_INTERVAL``, the same window a running task's heartbeats get): a ServerApp that
has not started and sent its first heartbeat by then loses its token, the task goes back to
pending, and the SuperExec starts another. On a busy host, where importing PyTorch alone takes
longer, every new ServerApp misses the window too: six were refused in three minutes at load 35,
up to eight ran at once, and the run never began, with nothing said.

Two changes, to the claim of a task only (``claim_task`` of Flower's in-memory and SQL state):

- a claimed task's first window is ``start_window`` seconds (``--task-start-window``, default
  300); once it runs, its heartbeats get Flower's own window, so a ServerApp that dies is noticed
  as soon as before;
- a task claimed ``max_starts`` times (``--task-starts``, default 3) that never started is
  finished FAILED with the reason, so the run ends FAILED and says why (``flwr ls``,
  ``python -m fedvlm.status``) instead of starting ServerApps until someone stops it.

Nothing about what a task may do changes: its token, its secret and its pin are Flower's and the
project's as before. The guard (``check_flower``) finds both ``claim_task`` and the state each
extends; a Flower that reads otherwise gets no change, with a warning (its 30 s window and no
bound: speed and a clear error lost, nothing a party could exploit gained).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from fedvlm.deploy.flower_patches import lacking

log = logging.getLogger("fedvlm.deploy")

START_WINDOW_S, MAX_STARTS = 300.0, 3


def _states():
    from flwr.supercore.corestate.in_memory_corestate import InMemoryCoreState
    from flwr.supercore.corestate.sql_corestate import SqlCoreState

    return InMemoryCoreState, SqlCoreState


def check_flower() -> str | None:
    """Why the installed Flower's task claims are not the ones this changes (None: they are)."""
    try:
        memory, sql = _states()
        from flwr.common.constant import SubStatus
        from flwr.supercore.state.schema.corestate_models import Task as TaskModel
    except ImportError as err:
        return f"it does not have {err.name}"
    if why := lacking(memory, "claim_task", "finish_task") or lacking(sql, "claim_task", "finish_task"):
        return why
    if not hasattr(TaskModel, "active_until") or not hasattr(TaskModel, "token") or not hasattr(SubStatus, "FAILED"):
        return "its task table has no active_until/token"
    return None


def _extend_in_memory(state, task_id: int, token: str, until) -> None:
    with state.lock_task_store:
        record = state.task_token_store.get(task_id)
        if record is not None and record.token == token:
            record.active_until = until


def _extend_sql(state, task_id: int, token: str, until) -> None:
    from flwr.supercore.state.schema.corestate_models import Task as TaskModel
    from flwr.supercore.utils import uint64_to_int64
    from sqlalchemy import update

    with state.session() as session:
        session.execute(
            update(TaskModel)
            .where(TaskModel.task_id == uint64_to_int64(task_id), TaskModel.token == token)
            .values(active_until=until)
        )


def bounded_claims(
    claim: Callable[..., str | None], extend: Callable, start_window: float, max_starts: int
) -> Callable[..., str | None]:
    """``claim`` (a state's ``claim_task``) with the first window ``start_window`` seconds, and a
    task's ``max_starts + 1``-th claim refused and the task finished FAILED with the reason."""
    claims: dict[int, int] = {}
    lock = threading.Lock()

    @functools.wraps(claim)
    def claim_task(self, task_id: int) -> str | None:
        from flwr.common.constant import Status, SubStatus
        from flwr.supercore.date import now

        with lock:
            started = claims.get(task_id, 0)
        if started >= max_starts and self.get_tasks(task_ids=[task_id], statuses=[Status.PENDING]):
            reason = (
                f"started {started} times, and each did not begin within --task-start-window ({start_window:g} s): "
                "the host is too busy to start it (raise --task-start-window, or free the host)"
            )
            if self.finish_task(task_id, SubStatus.FAILED, reason):
                log.error("task %d not started again: %s", task_id, reason)
            return None
        token = claim(self, task_id)
        if token is not None:
            with lock:
                claims[task_id] = started + 1
            extend(self, task_id, token, now() + timedelta(seconds=start_window))
            if started:
                log.warning(
                    "task %d claimed again (start %d of at most %d): its last start did not begin within %g s",
                    task_id,
                    started + 1,
                    max_starts,
                    start_window,
                )
        return token

    return claim_task


def install(start_window: float = START_WINDOW_S, max_starts: int = MAX_STARTS) -> bool:
    """Bound the task claims of Flower's SuperLink state in this process; False (with a warning)
    when Flower's state is not the one this was written for."""
    if not (start_window > 0 and max_starts >= 1):
        raise ValueError(
            f"--task-start-window must be positive and --task-starts at least 1; got {start_window} and {max_starts}"
        )
    from fedvlm.deploy import flower_patches

    if not flower_patches.applies("task-claims"):
        return False
    memory, sql = _states()
    for cls, extend in ((memory, _extend_in_memory), (sql, _extend_sql)):
        cls.claim_task = bounded_claims(cls.claim_task, extend, start_window, max_starts)
    return True
