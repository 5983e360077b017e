"""What a bench's figures were measured on, and with what: the machine and its load
(``machine``, ``bench_report``), and the CPU seconds per program of a process tree (``TreeCpu``),
the profile every change to the message path is measured with."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from fedvlm.utils.processes import DEFAULT_SHARE, descendants, pids_matching, program


def machine() -> dict:
    """What a bench's figures were measured on: the machine, its load, this process's threads and
    niceness, and what simulated clients get by default (``DEFAULT_SHARE``)."""
    import platform

    torch = sys.modules.get("torch")  # its threads only where the bench uses it
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "simulated_client": {"threads": DEFAULT_SHARE.threads, "niceness": DEFAULT_SHARE.niceness},
    }


def bench_report(payload: dict | list) -> dict:
    """A bench's JSON: its figures beside ``machine()`` as it was when they were taken."""
    return {"machine": machine(), **(payload if isinstance(payload, dict) else {"rows": payload})}


TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> tuple[int, float, float] | None:
    """(parent, own CPU s, CPU s of its children it has waited for) of a process, or None."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[1]), (int(f[11]) + int(f[12])) / TICK, (int(f[13]) + int(f[14])) / TICK
    except (OSError, IndexError, ValueError):
        return None


def _program_of(pid: int) -> str:
    name = program(pid)
    # a Ray worker starts as setup_worker.py, then default_worker.py, and titles itself by its task
    return "ray worker" if name.startswith("ray::") or name in ("setup_worker.py", "default_worker.py") else name


class TreeCpu:
    """CPU seconds per program of every process whose command line contains ``fragment`` and of
    their descendants, sampled every ``interval`` s while active: by CPU time rather than wall
    time, machine load does not distort it. A program's ``own`` is its processes' time; its
    ``children`` is what processes it started and waited for used, counted once they are reaped
    (a ClientApp that lives for one message between two samples is not missed); a process that
    ended with its parent still here is counted in the parent's ``children``.

    ``start`` (a callable) moves the zero: the first time it returns True (a run's first round is
    done, say) the profile so far is set aside, and ``by_program()`` counts from there."""

    def __init__(self, fragment: str, start=None, interval: float = 0.25):
        self.fragment, self.interval, self._start = fragment, interval, start
        self.seen: dict[int, tuple[str, int, float, float]] = {}  # pid -> program, parent, own, children
        self.alive: set[int] = set()
        self.zero: dict[int, tuple[str, float, float]] = {}  # counted() at the zero
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        roots = pids_matching(self.fragment)
        self.alive = set(roots).union(*(descendants(r) for r in roots)) if roots else set()
        for pid in self.alive:
            got = _cpu(pid)
            if got is not None:
                name = self.seen[pid][0] if pid in self.seen else _program_of(pid)
                self.seen[pid] = (name, *got)

    def counted(self) -> dict[int, tuple[str, float, float]]:
        """pid -> (program, own, children) of every process whose time is its own to count: not
        one that ended with its parent still here (its time is in the parent's children's)."""
        return {
            pid: (name, own, children)
            for pid, (name, parent, own, children) in self.seen.items()
            if pid in self.alive or parent not in self.alive
        }

    def by_program(self) -> dict[str, dict[str, float]]:
        """CPU seconds per program since the zero (``processes``: every one it ever had). A
        process counted at the zero and reaped since is in its parent's children's time whole,
        its time before the zero too: that part comes off the parent's program."""
        self.sample()
        now, out = self.counted(), {}
        for name, own, children in now.values():
            row = out.setdefault(name, {"processes": 0, "own": 0.0, "children": 0.0})
            row["processes"] += 1
            row["own"] += own
            row["children"] += children
        for pid, (name, own, children) in self.zero.items():
            if pid in now:
                out[name]["own"] -= own
                out[name]["children"] -= children
            else:
                parent = self.seen[pid][1]
                out[self.seen[parent][0]]["children"] -= own + children
        return {
            name: {
                "processes": row["processes"],
                **{k: round(v, 2) for k, v in (("own", row["own"]), ("children", row["children"]))},
                "total": round(row["own"] + row["children"], 2),
            }
            for name, row in sorted(out.items())
        }

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
            if self._start is not None and self._start():
                self.zero, self._start = self.counted(), None

    def __enter__(self) -> TreeCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
