"""ClientApp processes forked from a warm parent instead of started from nothing.

Flower's SuperExec starts a new ClientApp process for every message a node receives
(``SubprocessExecutor``: ``subprocess.Popen([command, args...])``). With a warm node worker
holding the model and data, that process only forwards the message, yet it first spends more than
a second of CPU importing Flower (gRPC, protobuf, cryptography): most of a warm message's cost,
twice per node per round (docs/results/deployment.md, 'Deployment speed: a warm node worker';
this patch's row in ``deploy.flower_patches``).

``pinned_app exec`` therefore starts, before Flower's SuperExec opens any connection, one fork
server: a process that imports what a ClientApp process imports (Flower's ClientApp runtime, the
pin check, and the modules the entry's module names in its ``WARM``: this package's own ClientApp
module, installed on the node, never a FAB's code), runs its ``prepare`` (what each child would
compute again with the same answer) and then waits on a pipe. The SuperExec's ``Popen`` of the ClientApp
command is replaced, in that one module, by a stand-in that writes the arguments to the pipe;
the server forks, and the child runs exactly what ``fedvlm-clientapp`` runs with those arguments
(``pinned_app.clientapp_main``, named to the server as ``module:function``) and exits with its
status. Any other command still gets a real
process.

Why every guarantee still holds: the child runs the same code with the same arguments as the
process it replaces, so the pin is checked in the child against the run's FAB before any of it
is unpacked, and the token, addresses and parent monitor are the SuperExec's own. It skips only
the imports. The server runs no task itself and holds nothing of a run: every child starts from
the same state, which no earlier message has touched (a warm module's import ran no run's code:
the FAB's copy of it is never imported, as a child's ``fedvlm.*`` import resolves through the
node's installed ``fedvlm`` either way), and shares no memory with another child
that either can change (fork copies on write). The server is single-threaded when it forks
(checked before it serves: fork in a process with other threads could copy a lock held by one),
and it is the SuperExec's child, so stopping the SuperExec's process tree stops it and the
ClientApps it started; it exits when the SuperExec's end of the pipe closes, is killed when the
SuperExec dies, and each ClientApp it forked is killed when it dies (``die_with_parent``), as
Flower's own ClientApp processes end with their parent. If it is gone, the stand-in starts a
real process, as Flower would.
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType

from fedvlm.deploy import flower_patches

log = logging.getLogger("fedvlm.exec")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def thread_count() -> int:
    """The process's threads, as the kernel counts them (gRPC's own threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def die_with_parent(parent: int) -> None:
    """Linux: this process is killed when ``parent`` dies (``prctl(PR_SET_PDEATHSIG)``), and exits
    now if it already has. A ClientApp forked here has the fork server for parent, not the
    SuperExec: without this, one still running when the node is torn down outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


def _entry(target: str) -> Callable[[], object]:
    """``module:function``, imported: what the ClientApp command runs."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _run_child(entry: Callable[[], object], argv: list[str], quiet: bool, server: int) -> None:
    """In the forked child: ``entry`` with ``argv`` as the command line; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server reaps its children; the app may wait on its own
        die_with_parent(server)
        if quiet:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
        sys.argv = argv
        entry()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the process would, then the status
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(_signum: int, _frame: object) -> None:
    """Wait for every ClientApp that has finished: none stays a zombie, and its CPU is added to
    this server's children's, where a per-program CPU profile (bench/measure.py's ``TreeCpu``)
    reads it; reaped by the kernel instead (SIGCHLD ignored), it was counted nowhere once gone."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:  # no child left
        pass


def serve(target: str, requests: Iterable[str] | None = None) -> int:
    """The fork server for the command whose code is ``target`` (``module:function``): one JSON
    request per line on stdin (``{"argv": [...], "quiet": bool}``), one forked child running it
    each; ends at end of input."""
    superexec = os.getppid()
    # numpy (which Flower imports) starts an OpenBLAS thread pool of cores - 1 threads: one BLAS
    # thread keeps the server single-threaded; the children's torch keeps its own threads
    blas = os.environ.pop("OPENBLAS_NUM_THREADS", None)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import flwr.supernode.cli.flwr_clientapp  # noqa: F401 - what every ClientApp process imports
    import flwr.supernode.runtime.run_clientapp  # noqa: F401
    import httpcore  # noqa: F401 - httpx imports it with the Runtime API client's first transport

    entry = _entry(target)
    home = sys.modules[entry.__module__]
    for module in getattr(home, "WARM", ()):  # what every child would import again
        importlib.import_module(module)
    getattr(home, "prepare", lambda: None)()  # what every child would compute again
    del os.environ["OPENBLAS_NUM_THREADS"]
    if blas is not None:
        os.environ["OPENBLAS_NUM_THREADS"] = blas

    threads = thread_count()
    if threads != 1:
        log.error("the ClientApp fork server has %d threads after its imports; fork needs one: not serving", threads)
        return 3
    die_with_parent(superexec)  # and its children with it (die_with_parent in each)
    server = os.getpid()
    signal.signal(signal.SIGCHLD, _reap)
    for line in requests if requests is not None else sys.stdin:
        request = json.loads(line)
        if os.fork() == 0:
            _run_child(entry, [str(a) for a in request["argv"]], bool(request.get("quiet")), server)
    return 0


class ForkingPopen:
    """Stands in for the ``subprocess`` module inside Flower's ``SubprocessExecutor`` only: a
    ``Popen`` of ``command`` becomes a request to the fork server; anything else is the real
    ``subprocess``."""

    def __init__(self, command: str, server: subprocess.Popen):
        self.command = command
        self.server = server

    def Popen(self, args, *rest, **kwargs):  # noqa: N802 - the name it stands in for
        if args and str(args[0]) == self.command and self.server.poll() is None and self.server.stdin is not None:
            quiet = kwargs.get("stdout") is subprocess.DEVNULL
            try:
                argv = [Path(str(args[0])).name, *(str(a) for a in args[1:])]
                self.server.stdin.write(json.dumps({"argv": argv, "quiet": quiet}) + "\n")
                self.server.stdin.flush()
                return None  # Flower's executor keeps no handle on the processes it starts
            except (BrokenPipeError, OSError):
                log.warning("the ClientApp fork server is gone: starting ClientApp processes from scratch")
        return subprocess.Popen(args, *rest, **kwargs)

    def __getattr__(self, name: str):
        return getattr(subprocess, name)


def check_flower(module: ModuleType) -> str | None:
    """Why Flower's executor module is not the one this stands in for (None when it is): it must
    start each task with one ``subprocess.Popen`` whose handle it does not keep."""
    if getattr(module, "subprocess", None) is not subprocess:
        return "it does not use the module-level `subprocess`"
    launch = inspect.getsource(module.SubprocessExecutor.launch)
    if "subprocess.Popen(" not in launch or "= subprocess.Popen(" in launch:
        return "its launch no longer starts each task with an unkept subprocess.Popen"
    return None


def install(command: str, target: str) -> subprocess.Popen | None:
    """Start the fork server for ``command`` (its code: ``target``, ``module:function``) and put
    the stand-in into Flower's executor; None (with a warning) where Flower's executor is not
    the one this was written for."""
    import flwr
    import flwr.supercore.superexec.executor.subprocess_executor as executor

    problem = check_flower(executor)
    if problem is not None:
        log.warning(
            "Flower %s's SuperExec executor is not the one fedvlm's fork server knows (%s): every ClientApp "
            "starts as a new process",
            flwr.__version__,
            problem,
        )
        return None
    flower_patches.note_version("clientapp-forks")
    server = subprocess.Popen(
        [sys.executable, "-m", "fedvlm.deploy.clientapp_forks", target], stdin=subprocess.PIPE, text=True
    )
    executor.subprocess = ForkingPopen(command, server)  # type: ignore[assignment]  # a stand-in for the module
    log.info("ClientApp processes are forked from a warm fork server (PID %d)", server.pid)
    return server


def main(argv: Sequence[str] | None = None) -> int:
    # no logging set up here: the children inherit it, and must start as a fresh process would
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or ":" not in args[0]:
        print("usage: python -m fedvlm.deploy.clientapp_forks MODULE:FUNCTION  (requests on stdin)", file=sys.stderr)
        return 2
    return serve(args[0])


if __name__ == "__main__":
    sys.exit(main())
