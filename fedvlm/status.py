"""Did a run succeed? An exit status a script can test, and the reason, from a run folder.

    python -m fedvlm.status [RUN_DIR]        # default: the newest run under ~/fedvlm-runs
    python -m fedvlm.status --runs DIR       # the newest run under DIR
    flwr run . && python -m fedvlm.status    # fail the command when the run did

``flwr run`` exits 0 even when the ServerApp fails; the run folder's ``results.json`` says what
happened (``server_app.results``). Exit status:

- 0: finished every round, and the last round heard back from enough of the clients it sampled;
- 1: failed (the ServerApp raised; its error is printed), or a resume of this run was refused
  after the folder was last written (``resume-refused.json``; the run itself is described too);
- 2: no run folder or no readable ``results.json``;
- 3: stopped early on the privacy budget (``privacy.max-epsilon``);
- 4: finished, but lost too many nodes: in the last training round more than ``--max-lost``
  (a fraction, default 0.5) of the sampled clients sent no usable reply;
- 5: not finished: interrupted (stopped from outside; ``resume`` continues it), still running,
  or killed (``results.json`` says when it was last written);
- 6: finished, but the one-run privacy audit it asked for (``privacy.audit-canaries``) is missing
  or proves a larger epsilon than the ledger accounts (results.json's ``audit``).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fedvlm.metrics import TRAIN_CLIENTS
from fedvlm.utils.files import RESULTS, UnreadableFile, read_results

OK, FAILED, UNREADABLE, STOPPED, LOST_NODES, UNFINISHED, AUDIT = 0, 1, 2, 3, 4, 5, 6
DEFAULT_RUNS = Path.home() / "fedvlm-runs"
# the lock a ServerApp holds on its run folder while it runs (server_app.resume.hold_run_dir); the
# kernel drops it when the process ends, however it ends
RUN_LOCK = "run.lock"


def held(run_dir: Path) -> bool | None:
    """Whether a live process holds ``run_dir``'s lock (its ServerApp is running); None where
    the folder has no lock file (written before locks were kept) or it cannot be read. The probe
    takes a shared lock for an instant and writes nothing."""
    try:
        fd = os.open(Path(run_dir) / RUN_LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        return True if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)  # closing the only descriptor releases a lock taken through it
    return False


@dataclass(frozen=True)
class Verdict:
    code: int
    reason: str


def newest_run(runs: Path) -> Path:
    """The run folder under ``runs`` whose results.json was written last."""
    found = sorted(runs.glob("*/results.json"), key=lambda p: p.stat().st_mtime) if runs.is_dir() else []
    if not found:
        raise FileNotFoundError(f"no run folder with a results.json under {runs}; pass the run folder itself")
    return found[-1].parent


def lost_by_round(rounds: list[dict]) -> list[tuple[int, int, int]]:
    """(round, clients sampled for training, of them without an accepted reply) of every round
    that trained: a reply timed out, failed, or rejected by the server's checks (a node restarted
    mid-round, say, whose round was trained and charged to its ledger all the same)."""
    found = []
    for record in rounds:
        sampled = int(record.get("sampled", 0))
        if sampled:
            trained = int(record.get("metrics", {}).get(TRAIN_CLIENTS, 0))
            found.append((int(record.get("round", 0)), sampled, sampled - trained))
    return found


def verdict(data: dict, max_lost: float, written_ago: float, alive: bool | None = None) -> Verdict:
    """``alive``: whether the run's ServerApp still holds its folder (``held``)."""
    run, rounds = data.get("run", {}), data.get("rounds", [])
    total = data.get("config", {}).get("num-server-rounds")
    done = f"{len(rounds)} of {total} rounds" if total else f"{len(rounds)} rounds"
    status, note = run.get("status", "unknown"), run.get("note", "")
    if status == "failed":
        return Verdict(FAILED, f"failed after {done}: {note}")
    if status == "stopped":
        return Verdict(STOPPED, f"stopped after {done}: {note}")
    if status == "interrupted":
        return Verdict(UNFINISHED, f"interrupted after {done}: {note}")
    if status == "running" and alive is False:
        return Verdict(
            UNFINISHED,
            f"interrupted after {done}: its ServerApp ended without finishing the run (stopped or killed; "
            f"results.json last written {written_ago:.0f} s ago); continue it with resume='<this run folder>'",
        )
    if status != "finished":
        return Verdict(
            UNFINISHED,
            f"{status} after {done}; results.json last written {written_ago:.0f} s ago (still running, or killed)",
        )
    trained = lost_by_round(rounds)
    lossy = [f"round {r} lost {lost} of {sampled}" for r, sampled, lost in trained if lost]
    over = [(r, sampled, lost) for r, sampled, lost in trained if lost / sampled > max_lost]
    if over:
        return Verdict(
            LOST_NODES,
            f"finished {done}, but {len(over)} round(s) lost more than --max-lost {max_lost:g} of the clients they "
            f"sampled ({'; '.join(lossy)}); see each round's 'dropped' in results.json",
        )
    failed_audit = audit_problem(data.get("audit"))
    if failed_audit:
        return Verdict(AUDIT, f"finished {done}, but its privacy audit failed: {failed_audit}")
    _, sampled, lost = trained[-1] if trained else (0, 0, 0)
    excluded = run.get("excluded_nodes") or {}
    extra = f"; {len(excluded)} node(s) excluded: {', '.join(excluded.values())}" if excluded else ""
    extra += f"; clients lost: {'; '.join(lossy)}" if lossy else ""
    return Verdict(OK, f"finished {done}, last training round heard from {sampled - lost} of {sampled}{extra}")


def audit_problem(section: object) -> str:
    """What in results.json's audit section fails the run ("" if nothing): an audit asked for that
    never came, or a node whose audit proves more epsilon than its ledger accounts."""
    if not isinstance(section, dict):
        return ""
    nodes = section.get("nodes")
    nodes = nodes if isinstance(nodes, dict) else {}
    found = [str(section["status"])] if str(section.get("status", "")).startswith("MISSING") else []
    found += [
        f"{name}: {node['status']}"
        for name, node in nodes.items()
        if isinstance(node, dict) and str(node.get("status", "")).startswith("BROKEN")
    ]
    return "; ".join(found)


MAX_LOST = 0.5  # the share of a last round's sampled clients a run may lose and still pass (--max-lost)


def _readable(path: Path) -> dict:
    """A side file the run writes beside results.json (status.json, resume-refused.json), or {}
    where there is none or it is not a JSON object: it only ever adds to what results.json says."""
    try:
        found = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def damage(data: dict) -> str | None:
    """What in results.json's content is not what a run writes, in the fields a verdict reads
    (None: nothing): a hand-edited or damaged file gets exit 2 naming the field, not a traceback."""
    rounds, excluded = data.get("rounds"), (data.get("run") or {}).get("excluded_nodes") or {}
    if not isinstance(data.get("run", {}), dict) or not isinstance(rounds, list):
        return "'run' is not an object or 'rounds' not a list"
    for i, record in enumerate(rounds):
        if not isinstance(record, dict) or not isinstance(record.get("metrics", {}), dict):
            return f"rounds[{i}] is not an object with an object of 'metrics'"
        for key in ("round", "sampled"):
            value = record.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int):
                return f"rounds[{i}].{key} = {value!r} is not a whole number"
    if not isinstance(excluded, dict) or not all(isinstance(v, str) for v in excluded.values()):
        return "run.excluded_nodes is not an object of node names to reasons"
    if (data.get("run") or {}).get("status") == "finished" and not rounds:
        return "it says the run finished but records no round"
    return None


def _refused_at(refused: dict) -> float:
    """When a resume was refused (``resume-refused.json``'s 'at'); a value that is not a time
    counts as the newest thing that happened to the folder, which the file's being there says."""
    try:
        at = float(refused.get("at", 0))
        time.localtime(at)
    except (TypeError, ValueError, OverflowError, OSError):
        return float("inf")
    return at


def check(run_dir: Path, max_lost: float = MAX_LOST) -> Verdict:
    path = Path(run_dir) / RESULTS
    # the status file is written in place at the end even when results.json could not be (a full disk)
    ended = _readable(Path(run_dir) / "status.json")
    try:
        data = read_results(run_dir, "restore it from a backup; without it the run's outcome is unknown")
    except UnreadableFile as err:
        if ended.get("status") == "failed":  # the run folder could not be written from the start
            return Verdict(FAILED, f"failed: {ended.get('note', '')}")
        return Verdict(UNREADABLE, str(err))
    damaged = damage(data)
    if damaged is not None:
        return Verdict(UNREADABLE, f"{path}: {damaged}; restore it from a backup (a run writes no such file)")
    if data.get("run", {}).get("status") == "running" and ended.get("status") not in (None, "running"):
        data["run"] = {**data["run"], "status": ended["status"], "note": ended.get("note", "")}
    found = verdict(data, max_lost, time.time() - path.stat().st_mtime, held(run_dir))
    # a resume refused after the folder was last written is the newest thing that happened to it
    # (server_app.resume.REFUSED: the refusal leaves results.json as it was)
    refused = _readable(Path(run_dir) / "resume-refused.json")
    if refused and _refused_at(refused) >= path.stat().st_mtime:
        at = _refused_at(refused)
        when = "an unreadable time" if at == float("inf") else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
        why = refused.get("reason", "?")
        return Verdict(FAILED, f"a resume was refused at {when}: {why} (the run itself: {found.reason})")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.status", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", nargs="?", type=Path, help="a run folder (default: the newest under --runs)")
    p.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help=f"where run folders are (default {DEFAULT_RUNS})")
    p.add_argument(
        "--max-lost",
        type=float,
        default=0.5,
        help="fraction of the last training round's sampled clients that may be lost (default 0.5)",
    )
    args = p.parse_args(argv)
    if not 0.0 <= args.max_lost <= 1.0:
        p.error(f"--max-lost is a fraction in [0, 1], got {args.max_lost}")
    try:
        run_dir = args.run_dir or newest_run(args.runs)
    except FileNotFoundError as err:
        print(f"fedvlm.status: {err}", file=sys.stderr)
        return UNREADABLE
    result = check(run_dir, args.max_lost)
    print(f"{run_dir}: {result.reason}")
    return result.code


if __name__ == "__main__":
    sys.exit(main())
