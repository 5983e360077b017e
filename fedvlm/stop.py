"""Stop a local simulation and everything it started.

    python -m fedvlm.stop [--flwr-home DIR]

``flwr run .`` starts a local SuperLink in the background (``$FLWR_HOME/local-superlink``, default
``~/.flwr``) and leaves it running after the run; if the ``flwr run`` command itself is stopped
(Ctrl-C), the run goes on inside it. The SuperLink runs Flower's SuperExec, which runs
``flwr-simulation``, which starts a Ray cluster (``gcs_server``, ``raylet``, a dashboard, log
and autoscaler monitors, and one worker per simulated ClientApp). Killing the SuperLink by name
(``pkill -f flower-superlink``) can leave the rest behind.

This finds that SuperLink by its own log path, gathers every process it started (its process tree,
and every process of the Ray session the tree belongs to, which may have been reparented), sends
them all SIGTERM, SIGKILL after a grace period, and checks that none is left. The run folders those
processes held (their ServerApps' ``run.lock``) and left saying "running" are then recorded as
interrupted, with the ``resume`` that continues them: a simulation's ServerApp runs in a thread of
``flwr-simulation``, which a signal never reaches, so it cannot record that itself. Exit code 0 when
everything stopped, 1 when something survived (listed), 0 with a note when nothing was running,
and 1 when nothing of this account's runs but another account's local SuperLink holds Flower's
local port (``flwr run .`` joins it: a run of this account may be running there).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from fedvlm.status import RUN_LOCK, held
from fedvlm.utils.processes import cmdline, descendants, listener_uid, pids_matching

_RAY_SESSION = re.compile(r"/tmp/ray/session_[\w.-]+|(?<=--session_dir=)\S+|(?<=--session-dir=)\S+")


def flwr_home(explicit: str | None) -> Path:
    return Path(explicit or os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser().resolve()


def local_superlinks(home: Path) -> list[int]:
    """The local SuperLinks ``flwr run`` (or ``fedvlm.deploy.superlink --local``) started for
    ``home`` (their command line names its log)."""
    marker = str(home / "local-superlink") + os.sep  # a path inside it, not any path that ends so
    return [
        pid
        for pid in pids_matching(marker)
        if ("flower-superlink" in cmdline(pid) or "fedvlm.deploy.superlink" in cmdline(pid))
        and any(a.startswith(marker) for a in cmdline(pid).split())
    ]


def _ray_sessions(pids: Iterable[int]) -> set[str]:
    sessions: set[str] = set()
    for pid in pids:
        sessions.update(m.group(0).rstrip("/") for m in _RAY_SESSION.finditer(cmdline(pid)))
    return {s for s in sessions if "session_" in s}


def everything_started_by(roots: Iterable[int]) -> set[int]:
    """``roots``, their descendants, and every process of a Ray session among them."""
    tree = set(roots).union(*(descendants(r) for r in roots))
    for session in _ray_sessions(tree):
        tree.update(pids_matching(session))
    tree.discard(os.getpid())
    return tree


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def run_dirs_held_by(pids: Iterable[int]) -> set[Path]:
    """The run folders whose lock (``RUN_LOCK``) one of ``pids`` has open: their ServerApps."""
    found = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                target = Path(os.readlink(fd))
            except OSError:
                continue
            if target.name == RUN_LOCK:
                found.add(target.parent)
    return found


def record_interrupted(run_dirs: Iterable[Path]) -> list[str]:
    """Record each run folder left "running" by a ServerApp that is gone as interrupted; a line
    per folder saying what was done."""
    from fedvlm.server_app.results import RunRecorder

    lines = []
    for run_dir in sorted(run_dirs):
        if held(run_dir):
            lines.append(f"{run_dir}: still held by a running ServerApp, left as it is")
            continue
        try:
            recorder = RunRecorder.left_running(run_dir)
            if recorder.data.get("run", {}).get("status") != "running":
                continue
            done = len(recorder.data.get("rounds", []))
            recorder.finish("interrupted", f"stopped by python -m fedvlm.stop; continue it with resume='{run_dir}'")
        except Exception as err:  # one unreadable folder must not hide the others
            lines.append(f"{run_dir}: could not record the interruption: {err}")
            continue
        lines.append(f"{run_dir}: interrupted after round {done}; continue it with resume='{run_dir}'")
    return lines


def stop(roots: Iterable[int], grace: float = 15.0) -> list[int]:
    """SIGTERM everything ``roots`` started, SIGKILL what is left after ``grace`` seconds; the
    processes still alive after that (none, normally)."""
    roots = list(roots)
    victims = everything_started_by(roots)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        victims |= everything_started_by([p for p in roots if _alive(p)])  # started since
        for pid in victims:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + wait
        while time.time() < deadline and any(_alive(p) for p in victims):
            time.sleep(0.2)
    return sorted(p for p in victims if _alive(p))


def _nothing_of_yours(home: Path) -> int:
    """0 when no local SuperLink runs at all; 1 when another account's holds Flower's local port:
    ``flwr run .`` joins whatever SuperLink answers there, so a run of yours may be running in it,
    where this account can stop nothing."""
    # the port `flwr run .` probes and joins (flwr.cli.local_superlink: /health on the HTTP API
    # port; Flower 1.42 serves its Control API there too, and opens no control port of its own)
    port = int(os.environ.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "39091"))  # flwr.cli.constant's default
    owner = listener_uid(port)
    if owner is None or owner == os.getuid():
        print(f"no local SuperLink of {home} is running: nothing to stop")
        return 0
    print(
        f"no local SuperLink of {home} is running, but another account's (uid {owner}) holds Flower's local port "
        f"127.0.0.1:{port}: a `flwr run .` of yours joins it and runs there, where only that account can stop it "
        "(`flwr stop <run-id>` stops one run). Give your runs a port of your own (FLWR_LOCAL_SUPERLINK_HTTP_API_PORT "
        "in your environment) and start your local SuperLink guarded, `python -m fedvlm.deploy.superlink --local`, "
        "before `flwr run .`",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.stop", description=__doc__.split("\n\n")[0])
    p.add_argument("--flwr-home", help="the FLWR_HOME of the flwr run to stop (default: $FLWR_HOME or ~/.flwr)")
    p.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    args = p.parse_args(argv)
    home = flwr_home(args.flwr_home)
    roots = local_superlinks(home)
    if not roots:
        return _nothing_of_yours(home)
    victims = everything_started_by(roots)
    run_dirs = run_dirs_held_by(victims)
    print(f"stopping the local SuperLink of {home} and the {len(victims) - len(roots)} processes it started")
    left = stop(roots, args.grace)
    for line in record_interrupted(run_dirs):
        print(line)
    if left:
        print("still running: " + "; ".join(f"{pid} {cmdline(pid)[:100]}" for pid in left), file=sys.stderr)
        return 1
    print("stopped; `python -m fedvlm.status` tells whether the last run finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
