"""The SuperLink's task claims: a ServerApp gets the start window the operator sets, and a task
that never starts is finished FAILED with the reason after a bounded number of starts, on
Flower's own in-memory and SQLite states."""

from __future__ import annotations

import time

import pytest

from fedvlm.deploy import task_claims


@pytest.fixture
def bounded(monkeypatch):
    memory, sql = task_claims._states()
    for cls in (memory, sql):
        monkeypatch.setattr(cls, "claim_task", cls.claim_task)  # the install below is undone after the test
    assert task_claims.check_flower() is None
    assert task_claims.install(start_window=0.3, max_starts=3)


def _state(database: str):
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.constant import NOOP_FEDERATION_ID, TaskType
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager

    state = LinkStateFactory(database, NoOpFederationManager(), ObjectStoreFactory()).state()
    run = state.create_run(None, None, "h", {}, NOOP_FEDERATION_ID, None, None, TaskType.SERVER_APP)
    (task,) = state.get_tasks()
    return state, run, task.task_id


@pytest.mark.parametrize("database", ["memory", "sqlite"])
def test_a_serverapp_that_never_starts_is_started_three_times_then_the_run_fails_saying_why(
    bounded, database, tmp_path, caplog
):
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME

    state, run, task = _state(FLWR_IN_MEMORY_DB_NAME if database == "memory" else str(tmp_path / "state.db"))
    for start in range(3):
        assert state.claim_task(task) is not None, f"start {start + 1}"
        assert state.claim_task(task) is None  # claimed: nobody else starts it meanwhile
        time.sleep(0.45)  # past our 0.3 s window (Flower's own is 30 s): the task is pending again
        assert state.get_run_status({run})[run].status == "pending"
    with caplog.at_level("ERROR", logger="fedvlm.deploy"):
        assert state.claim_task(task) is None  # the fourth start is refused
    status = state.get_run_status({run})[run]
    assert (status.status, status.sub_status) == ("finished", "failed")
    assert "started 3 times" in status.details and "--task-start-window (0.3 s)" in status.details
    assert "not started again" in caplog.text


def test_a_serverapp_that_starts_keeps_flowers_heartbeats(bounded):
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME

    state, run, task = _state(FLWR_IN_MEMORY_DB_NAME)
    assert state.claim_task(task) is not None
    assert state.activate_task(task)  # it started within the window: Flower's own window from now on
    time.sleep(0.45)
    assert state.get_run_status({run})[run].status == "running"


def test_windows_and_bounds_outside_reason_are_refused():
    with pytest.raises(ValueError, match="--task-start-window must be positive"):
        task_claims.install(start_window=0, max_starts=3)
    with pytest.raises(ValueError, match="--task-starts at least 1"):
        task_claims.install(start_window=10, max_starts=0)


def test_a_finished_task_whose_handle_flower_dropped_is_reaped_on_the_next_pass(monkeypatch):
    """Flower's executor drops each task's Popen: the child stayed a zombie until the next start.
    The SuperExec's loop calls reconcile on every pass; with the patch that pass reaps it."""
    import gc
    import subprocess
    from pathlib import Path

    from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

    from fedvlm.deploy import task_reaping

    monkeypatch.setattr(SubprocessExecutor, "reconcile", SubprocessExecutor.reconcile)  # undone after
    assert task_reaping.check_flower() is None and task_reaping.install()
    child = subprocess.Popen(["sleep", "0.2"])  # as Flower's launch does: started, its handle dropped
    pid = child.pid
    del child
    gc.collect()
    time.sleep(0.6)

    def state() -> str:
        stat = Path(f"/proc/{pid}/stat")
        return stat.read_text().rsplit(")", 1)[1].split()[0] if stat.exists() else "gone"

    assert state() == "Z"  # finished, not reaped: what the SuperLink's container showed
    SubprocessExecutor().reconcile()
    assert state() == "gone"
