"""Process helpers for running real Flower processes (sweeps, tests, benchmarks): ``flwr run``
with its own Flower home and ports, stopping a process with all its descendants by PID (also
when a test fails), and the peak memory of a process tree."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLWR = str(Path(sys.executable).with_name("flwr"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def tcp_sockets(tables: Sequence[str] = ()) -> Iterator[list[str]]:
    """This machine's TCP sockets, one row of the kernel's table each (columns: sl, local and
    remote address as hex ip:port, state, ..., uid at 7, ..., inode at 9)."""
    for table in tables or TCP_TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        yield from (line.split() for line in lines)


def listener_uid(port: int) -> int | None:
    """The account whose socket listens on TCP ``port`` of this machine, or None."""
    for cols in tcp_sockets():
        if len(cols) > 7 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
            return int(cols[7])
    return None


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


def cmdline(pid: int) -> str:
    """A process's command line, arguments joined by spaces ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids_matching(fragment: str) -> list[int]:
    """Every other process whose command line contains ``fragment``."""
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and int(p.name) != os.getpid() and fragment in cmdline(int(p.name))
    ]


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


# Where a machine has at most this many cores, a simulated client gets one OpenMP thread.
FEW_CORES = 4


@dataclass(frozen=True)
class ClientShare:
    """What each simulated client (a Ray actor of Flower's simulation engine) gets of the machine.

    Ray gives an actor as many OpenMP threads as its ``client-resources-num-cpus`` (Flower's
    default: 2) and starts its workers at nice ``RAY_worker_niceness`` (Ray's default: 15). Beside
    other work that collapsed a 10-client round from 2.8 s to 110 s: threads spinning at a barrier
    while a sibling waits for a core, at a priority below every other job. By default a client
    here gets one thread where cores are few, two elsewhere (Flower's), and the host's own
    priority; the operator sets either (``--federation-config``, ``RAY_worker_niceness``)."""

    threads: int = 1 if (os.cpu_count() or 1) <= FEW_CORES else 2
    niceness: int = 0

    def federation(self) -> str:
        return f"client-resources-num-cpus={self.threads}"

    def env(self) -> dict[str, str]:
        """Read by Ray's raylet when it starts: the SuperLink's environment, which the simulation inherits."""
        return {"RAY_worker_niceness": str(self.niceness)}

    def record(self) -> dict:
        """The settings and the machine's load, beside a bench's figures."""
        return {
            "client_threads": self.threads,
            "client_niceness": self.niceness,
            "cpus": os.cpu_count(),
            "load_1min": round(os.getloadavg()[0], 2),
        }


DEFAULT_SHARE = ClientShare()


def flwr_env(home: Path, share: ClientShare = DEFAULT_SHARE) -> dict[str, str]:
    """Environment for ``flwr run`` with its own FLWR_HOME and a local simulation SuperLink on
    free ports, so that a SuperLink already running on this machine is never reused; stop what it
    started with ``kill_tree`` on ``pids_matching(str(home))``. Simulated clients run at the
    niceness of ``share``."""
    return dict(
        os.environ,
        **share.env(),
        FLWR_HOME=str(home),
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()),
        FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        # flwr starts `flower-superlink` by name: it must be the one beside this Python
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )


def run_config_arg(raw: dict) -> str:
    """A flat run config as ``flwr run --run-config``'s TOML-like ``key=value`` list."""
    return " ".join(
        f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
        for k, v in raw.items()
    )


# How long a local SuperLink may take to answer. Flower's CLI gives the one it starts 15 s, which a
# busy host (load 20) overran: every `flwr run` of a bench then failed before its first round.
SUPERLINK_START_S = 300.0


def _answers(port: str) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).is_success
    except httpx.HTTPError:
        return False


def start_local_superlink(env: dict[str, str], bound: float = SUPERLINK_START_S) -> None:
    """Start the guarded local SuperLink (``fedvlm.deploy.superlink --local``) that ``flwr run`` with
    ``env`` uses, unless one answers already, and wait for it ``bound`` seconds at most; ``flwr
    run`` then finds it answering and starts none of its own. It runs detached, with its command
    line under ``$FLWR_HOME``: stop it with ``kill_tree`` on ``pids_matching(FLWR_HOME)``."""
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    if _answers(port):
        return
    log = Path(env["FLWR_HOME"]) / "local-superlink" / "start.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedvlm.deploy.superlink", "--local"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the local SuperLink exited with code {proc.returncode} before answering: see {log}")
        if _answers(port):
            return
        time.sleep(0.2)
    kill_tree(proc.pid)
    raise TimeoutError(
        f"the local SuperLink did not answer on 127.0.0.1:{port} within {bound:.0f} s (load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): wait for the machine to calm down, or give a "
        f"longer bound; its log: {log}"
    )


def flwr_run(
    env: dict[str, str], run_config: dict | str, supernodes: int = 10, timeout: float = 900, federation: str = ""
) -> subprocess.CompletedProcess:
    """``flwr run`` of this app in simulation with ``supernodes`` virtual nodes (and the further
    ``--federation-config`` options in ``federation``; each client's CPUs, and so its threads,
    are ``ClientShare``'s unless it names ``client-resources-num-cpus``); output captured. It
    starts the local SuperLink itself first, with this module's bound on its start-up instead of
    Flower's 15 s."""
    start_local_superlink(env)
    if "client-resources-num-cpus" not in federation:
        federation = f"{DEFAULT_SHARE.federation()} {federation}"
    return subprocess.run(
        [
            FLWR,
            "run",
            str(ROOT),
            "--stream",
            "--federation-config",
            f"num-supernodes={supernodes} {federation}".strip(),
            "--run-config",
            run_config if isinstance(run_config, str) else run_config_arg(run_config),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB; PSS shares each shared page among its users, so a sum
    over processes does not count the same library pages once per Ray worker."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return rss, pss


def program(pid: int) -> str:
    """The program a process runs: the module for ``python -m module``, the script's name for
    ``python script``, else the executable's (a forked process keeps its parent's)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    name = Path(argv[0].decode(errors="replace")).name
    if name.startswith("python") and len(argv) > 2 and argv[1] == b"-m":
        return argv[2].decode(errors="replace")
    if name.startswith("python") and len(argv) > 1 and argv[1] and not argv[1].startswith(b"-"):
        name = Path(argv[1].decode(errors="replace")).name
    return name


class TreeMemory:
    """Samples, every ``interval`` seconds while active, the summed RSS and PSS of every process
    whose command line contains ``fragment`` and of all their descendants (a ``flwr run``: the
    SuperLink, the ServerApp, the simulation and its Ray workers; a loopback federation: also
    every SuperNode and the ClientApp processes they start); keeps the peaks in MiB and, at the
    PSS peak, the processes per program (``peak_by_program``: name -> count, RSS, PSS); and, where
    ``nvidia-smi`` runs, the peak GPU memory those processes hold (``peak_gpu_mib``)."""

    def __init__(self, fragment: str, interval: float = 0.5):
        self.fragment, self.interval = fragment, interval
        self.peak_rss_mib = self.peak_pss_mib = self.peak_gpu_mib = 0.0
        self.peak_by_program: dict[str, dict[str, float]] = {}
        self._smi = shutil.which("nvidia-smi")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            roots = pids_matching(self.fragment)
            pids = set(roots).union(*(descendants(r) for r in roots)) if roots else set()
            by: dict[str, dict[str, float]] = {}
            for pid in pids:
                rss, pss = _memory_kib(pid)
                row = by.setdefault(program(pid), {"processes": 0, "rss_mib": 0.0, "pss_mib": 0.0})
                row["processes"] += 1
                row["rss_mib"] += rss / 1024
                row["pss_mib"] += pss / 1024
            self.peak_rss_mib = max(self.peak_rss_mib, sum(r["rss_mib"] for r in by.values()))
            if self._smi:
                self.peak_gpu_mib = max(self.peak_gpu_mib, self._gpu_mib(pids))
            pss_mib = sum(r["pss_mib"] for r in by.values())
            if pss_mib > self.peak_pss_mib:
                self.peak_pss_mib = pss_mib
                self.peak_by_program = {k: {n: round(v, 1) for n, v in r.items()} for k, r in sorted(by.items())}

    def _gpu_mib(self, pids: set[int]) -> float:
        """GPU memory held by ``pids`` (nvidia-smi's per-process figures, MiB)."""
        try:
            out = subprocess.run(
                [str(self._smi), "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return 0.0
        rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
        return sum(float(mib) for pid, mib in rows if pid.strip().isdigit() and int(pid) in pids)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
