"""Process helpers for running real Flower processes (tests, benchmarks): free ports, and
stopping a process with all its descendants by PID (also when the test fails)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(p.name))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def pids_matching(fragment: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if fragment in cmd and int(p.name) != os.getpid():
                found.append(int(p.name))
    return found


def kill_tree(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM ``pid`` and every descendant, then SIGKILL whatever is left."""
    victims = [pid, *descendants(pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for v in victims:
            try:
                os.kill(v, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + timeout
        while time.time() < deadline and any(Path(f"/proc/{v}").exists() and not _zombie(v) for v in victims):
            time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) == "Z"
    except OSError:
        return True
