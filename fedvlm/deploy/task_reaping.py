"""Flower's SuperExec that reaps a finished ServerApp (or spawned ClientApp) at once.

    python -m fedvlm.deploy.task_reaping <flower-superexec's arguments>

Flower 1.42's subprocess executor starts each task with a ``subprocess.Popen`` whose handle it
does not keep. Python reaps such a child only when the next ``Popen`` is made: a ServerApp that
finished stayed a zombie in the SuperLink's container until the next run started (20 to 60 s
and more after a run; its parent is the live SuperExec, so the container's init cannot reap it).

The SuperExec calls its executor's ``reconcile`` on every pass of its task loop (every
``--task-poll`` seconds); here that also reaps every finished child whose handle was dropped,
with the standard library's own ``subprocess._cleanup`` (which polls only those handles, so no
other child's exit status is taken from its owner). ``check_flower`` finds the loop's
``reconcile`` and the standard library's reaper; a Python or Flower without either runs
unchanged, with a warning (zombies until the next start, as before).
"""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
from collections.abc import Callable

from fedvlm.deploy import flower_patches

log = logging.getLogger("fedvlm.deploy")


def check_flower() -> str | None:
    """Why this Flower's SuperExec or this Python is not what the reaper is written for (None: it is)."""
    from flwr.supercore.superexec import run_superexec
    from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

    if why := flower_patches.lacking(subprocess, "_cleanup"):
        return why
    if "executor.reconcile()" not in inspect.getsource(run_superexec.run_superexec):
        return "the SuperExec's task loop no longer calls its executor's reconcile"
    return flower_patches.lacking(SubprocessExecutor, "reconcile")


def reaping(reconcile: Callable[..., None]) -> Callable[..., None]:
    def reconcile_and_reap(self) -> None:
        reconcile(self)
        subprocess._cleanup()  # type: ignore[attr-defined]  # the stdlib's reaper of dropped handles

    return reconcile_and_reap


def install() -> bool:
    if not flower_patches.applies("task-reaping"):
        return False
    from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

    SubprocessExecutor.reconcile = reaping(SubprocessExecutor.reconcile)  # type: ignore[method-assign]
    return True


def main() -> None:
    from flwr.supercore.cli.flower_superexec import flower_superexec

    install()
    sys.argv = ["flower-superexec", *sys.argv[1:]]
    flower_superexec()


if __name__ == "__main__":
    main()
