"""A real deployment on one machine: a SuperLink with TLS and SuperNode authentication, its
Fleet gateway, and SuperNodes that run only the pinned app, as separate processes on loopback,
for trying the deployment path before using several machines, and for the loopback tests.

    python -m fedvlm.deploy.local_federation --workdir /tmp/fedvlm-fed --supernodes 2 \\
        --run-config "num-server-rounds=2"

does, in order, what docs/deployment.md tells organisations to do on their own machines:
credentials (``deploy.credentials``), ``flower-superlink`` (behind ``deploy.superlink``) with TLS and
``--enable-supernode-auth`` listening on 127.0.0.1 only, the Fleet gateway
(``deploy.fleet_gateway``) on the federation's "public" address (here 127.0.0.2, another
loopback address, so that what is reachable only on the SuperLink host is told apart), a
researcher's connection in ``$FLWR_HOME/config.toml`` to the SuperLink on its host,
``flwr supernode register`` for every SuperNode's public key, and per organisation a
``flower-supernode`` (process isolation, dialling the gateway) with its pinned SuperExec
(``deploy.pinned_app exec``, pinned to this checkout's app), then ``flwr run . <connection>``.
Every process is started in its own session and stopped by PID, also on errors and Ctrl-C.

At scale (``--supernodes 20 --report scale.json``) it also measures what the federation costs
on this machine: the peak memory of every process it started, summed per program, each round's
time, and the replies the SuperNodes logged as lost. Every message a SuperNode receives starts
a ClientApp process that imports torch and loads the model, so N SuperNodes on one machine run
N such processes at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedvlm.deploy.credentials import generate
from fedvlm.deploy.long_pulls import HOLD_S
from fedvlm.deploy.pinned_app import build_hash
from fedvlm.metrics import EVAL_CLIENTS, TRAIN_CLIENTS
from fedvlm.protocol import SECURE_IDENTITY, SECURE_ROSTER
from fedvlm.utils.processes import TreeMemory, free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONNECTION = "loopback"
HOST = "127.0.0.1"  # the SuperLink host's own loopback: the SuperLink listens only here
PUBLIC = "127.0.0.2"  # where SuperNodes (and anyone else on the network) reach the federation
EXEC = "-exec"  # suffix of a SuperNode's SuperExec process name


def flower_env(home: Path) -> dict[str, str]:
    """Environment for every Flower process: our own FLWR_HOME, no telemetry or update checks
    (machines may be offline), no runtime dependency installation (the app's dependencies are
    installed on every machine beforehand)."""
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    return env


@dataclass(frozen=True)
class NodeWaits:
    """How often an organisation's processes look for work, in seconds: the SuperNode between
    empty pulls and between looks for a reply (deploy.supernode_polling), the SuperExec between
    looks for a task (pinned_app exec --task-poll). ``FLOWER_WAITS`` are Flower's own."""

    idle_poll: float = 0.5
    reply_poll: float = 0.1
    task_poll: float = 0.2


FLOWER_WAITS = NodeWaits(3.0, 0.5, 1.0)
OUR_WAITS = NodeWaits()


class LocalFederation:
    """A SuperLink and SuperNodes as real processes on loopback (see the module docstring)."""

    def __init__(
        self,
        workdir: Path,
        supernodes: list[str],
        node_configs: dict[str, str] | None = None,
        node_env: dict[str, dict[str, str]] | None = None,
        workers: Sequence[str] = (),
        waits: NodeWaits = OUR_WAITS,
        fork: bool = True,
        database: bool = True,
        cache_dir: Path | None = None,
        pull_hold: float = HOLD_S,
    ):
        self.dir = Path(workdir).resolve()
        self.names = list(supernodes)
        self.node_configs = dict(node_configs or {})
        # extra environment of an organisation's processes (its SuperNode, SuperExec and the
        # ClientApps they start), e.g. CUDA_VISIBLE_DEVICES to give each node its own GPU
        self.node_env = dict(node_env or {})
        # the organisations with a warm node worker (client_app.worker) beside their SuperNode
        self.workers = set(workers)
        self.waits = waits
        # each ClientApp forked from its SuperExec's fork server (deploy.clientapp_forks), or a new process
        self.fork = fork
        # the SuperLink's state in an SQLite file (survives a SuperLink restart) or in its memory
        self.database = database
        # where the organisations' nodes cache (a real node's cache is its own, never the run
        # config's: client_app.node_policy); None: each node's default
        self.cache_dir = cache_dir
        self.pull_hold = pull_hold  # how long the SuperLink holds an empty pull (deploy.long_pulls)
        self.creds = self.dir / "credentials"
        self.home = self.dir / "flwr-home"
        self.env = flower_env(self.home)
        self.port = free_port()  # the SuperLink's, on HOST
        self.gateway_port = free_port()  # the Fleet gateway's, on PUBLIC
        self.pins = [build_hash(ROOT)[0]]  # the app the organisations agreed to: this checkout's
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    # ---- processes -------------------------------------------------------------------------
    def _start(self, name: str, cmd: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.logs[name] = log
        with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**self.env, **(extra_env or {})},
                cwd=self.dir,
                start_new_session=True,
                umask=0o077,  # what Flower writes (the SuperLink's database, a node's apps) is owner-only
            )
        self.procs[name] = proc
        return proc

    def org_env(self, name: str) -> dict[str, str]:
        """The extra environment of an organisation's processes. Its compute threads are its share
        of this machine's cores: on a machine of its own a node uses them all (torch's default),
        but the organisations here share one, and each with a thread per core would spend its
        time switching (bench/deployment_speed.py). Ray does the same for the simulation's actors
        (OMP_NUM_THREADS = the CPUs an actor is given). Its cache is ``cache_dir`` where one is
        given. ``node_env`` may set its own."""
        share = max(1, (os.cpu_count() or 1) // max(1, len(self.names)))
        cache = {"FEDVLM_CACHE": str(self.cache_dir)} if self.cache_dir else {}
        return {"OMP_NUM_THREADS": str(share), **cache, **self.node_env.get(name, {})}

    def log_text(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace") if name in self.logs and self.logs[name].exists() else ""

    def stop(self, name: str) -> None:
        """Stop a process, a SuperNode with its SuperExec."""
        for which in (f"{name}{EXEC}", name):
            proc = self.procs.get(which)
            if proc is not None:
                kill_tree(proc.pid)
                proc.wait(timeout=30)

    def stop_all(self) -> None:
        for name in list(self.procs)[::-1]:  # SuperNodes before the gateway and the SuperLink
            self.stop(name)

    def lost_replies(self) -> int:
        """Replies the SuperNodes logged as not delivered: Flower's SuperNode does not push a
        reply again after the SuperLink answered its push with an error."""
        return sum(self.log_text(n).count("Failed to send message") for n in self.names)

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    # ---- the steps of docs/deployment.md ------------------------------------------------------
    def make_credentials(self, extra: Sequence[str] = ()) -> None:
        generate(self.creds, [], [PUBLIC], [*self.names, *extra])  # loopback is always in the certificate

    def start_superlink(self) -> None:
        """Flower's SuperLink behind the host's lock (deploy.superlink): only this account reaches
        it, its own SuperExec takes the ServerApp's tasks with a secret, and every ServerApp signs
        its instructions."""
        c = self.creds
        self._start(
            "superlink",
            [
                sys.executable,
                "-m",
                "fedvlm.deploy.superlink",
                "--signing-key",
                str(c / "server-signing.key"),
                f"--pull-hold={self.pull_hold}",
                "--",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--ssl-ca-certfile",
                str(c / "ca.crt"),
                "--ssl-certfile",
                str(c / "server.crt"),
                "--ssl-keyfile",
                str(c / "server.key"),
                "--enable-supernode-auth",
                *(["--database", str(self.dir / "superlink-state.db")] if self.database else []),
                "--disable-runtime-dependency-installation",
            ],
        )
        self._wait_for_port(HOST, self.port, "superlink")

    def start_gateway(self) -> None:
        c = self.creds
        self._start(
            "gateway",
            [
                sys.executable,
                "-m",
                "fedvlm.deploy.fleet_gateway",
                "--listen",
                f"{PUBLIC}:{self.gateway_port}",
                "--superlink",
                f"{HOST}:{self.port}",
                "--certfile",
                str(c / "server.crt"),
                "--keyfile",
                str(c / "server.key"),
                "--ca",
                str(c / "ca.crt"),
            ],
        )
        self._wait_for_port(PUBLIC, self.gateway_port, "gateway")

    def write_connection(self) -> Path:
        """The researcher's side: a named SuperLink connection that verifies the server with our CA."""
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.home / "config.toml"
        path.touch(mode=0o600)
        path.write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{HOST}:{self.port}"\nroot-certificates = "{self.creds / "ca.crt"}"\n'
        )
        return path

    def register(self, name: str) -> subprocess.CompletedProcess:
        return self.flwr(
            "supernode",
            "register",
            str(self.creds / "supernodes" / f"{name}.pub"),
            CONNECTION,
            "--name",
            name,
            timeout=120,
        )

    def start_supernode(self, name: str, node_config: str | None = None, retry_for: float = 600) -> subprocess.Popen:
        """The organisation's SuperNode (process isolation, dialling the gateway) and its pinned
        SuperExec, which starts a ClientApp process per task only for the pinned app; the two
        share a secret so that no other process on the machine can take the node's tasks."""
        cfg = node_config if node_config is not None else self.node_configs.get(name, f"name='{name}'")
        if SECURE_ROSTER not in cfg:  # the roster it pins and its identity: what a secure round needs of it
            identity = self.creds / "supernodes" / f"{name}.identity"
            cfg = f"{cfg} {SECURE_ROSTER}='{self.creds / 'roster.json'}' {SECURE_IDENTITY}='{identity}'"
        if name in self.workers:
            cfg = f"{cfg} node-worker='{self.start_worker(name)}'"
        secret = self._secret(name)
        runtime_port = free_port()
        node = self._start(
            name,
            [
                sys.executable,
                "-m",
                "fedvlm.deploy.supernode",  # flower-supernode, started again while a crashed session times out
                *(f"--pin={p}" for p in self.pins),  # the SuperNode itself takes only runs of the pinned app
                f"--retry-for={retry_for}",
                f"--idle-poll={self.waits.idle_poll}",
                f"--reply-poll={self.waits.reply_poll}",
                "--",
                "--superlink",
                f"{PUBLIC}:{self.gateway_port}",
                "--root-certificates",
                str(self.creds / "ca.crt"),
                "--auth-supernode-private-key",
                str(self.creds / "supernodes" / name),
                "--isolation",
                "process",
                "--superexec-auth-secret-file",
                str(secret),
                "--host",
                HOST,
                "--port",
                str(runtime_port),
                "--node-config",
                cfg,
                "--max-retries",
                "30",
            ],
            self.org_env(name),
        )
        self._start_exec(name, runtime_port, secret)
        return node

    def _secret(self, name: str) -> Path:
        """The secret ``name``'s SuperNode and SuperExec share (made once, owner-only)."""
        secret = self.dir / "secrets" / name
        if not secret.exists():
            secret.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
        return secret

    def _start_exec(self, name: str, runtime_port: int, secret: Path) -> None:
        """``name``'s pinned SuperExec on its SuperNode's runtime API."""
        self._start(
            f"{name}{EXEC}",
            [
                sys.executable,
                "-m",
                "fedvlm.deploy.pinned_app",
                "exec",
                *(f"--pin={p}" for p in self.pins),
                f"--server-key={self.creds / 'server-signing.pub'}",  # it acts only on the federation's ServerApp
                f"--served-dir={self.dir / 'served' / name}",  # each signed message once
                f"--clientapp-start={'fork' if self.fork else 'spawn'}",
                f"--task-poll={self.waits.task_poll}",
                "--",
                "--runtime-api-address",
                f"{HOST}:{runtime_port}",
                "--insecure",
                "--superexec-auth-secret-file",
                str(secret),
            ],
            self.org_env(name),
        )

    def start_worker(self, name: str) -> Path:
        """The organisation's warm node worker, as its own user beside its SuperNode; its socket
        (0600, in a 0700 folder) is what the node config's ``node-worker`` names."""
        sock = self.dir / "workers" / f"{name}.sock"
        if f"{name}-worker" in self.procs and self.procs[f"{name}-worker"].poll() is None:
            return sock  # a restarted SuperNode finds its worker still warm
        self._start(
            f"{name}-worker",
            [sys.executable, "-m", "fedvlm.deploy.node_worker", "--socket", str(sock)],
            self.org_env(name),
        )
        deadline = time.time() + 120
        while not sock.exists():
            if self.procs[f"{name}-worker"].poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{name}'s node worker did not start:\n{self.log_text(f'{name}-worker')[-3000:]}")
            time.sleep(0.2)
        return sock

    def flwr(self, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "flwr"), *args], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )

    def run_config(self, run_config: str) -> str:
        """``run_config`` with the roster the ServerApp relays for, on its host (unless it names one):
        every run of this federation, so a run resumed from another has the same config."""
        if "secure-aggregation.roster" in run_config:
            return run_config
        return f"{run_config} secure-aggregation.roster='{self.creds / 'roster.json'}'"

    def run_app(self, run_config: str, timeout: float = 1800, echo: bool = False) -> subprocess.CompletedProcess:
        """`flwr run . loopback --stream`: the researcher's command against this federation;
        with ``echo`` its output is also printed as it comes (rounds, epsilon, accuracy)."""
        cmd = [str(BIN / "flwr"), "run", str(ROOT), CONNECTION, "--stream", "--run-config", self.run_config(run_config)]
        if not echo:
            return self.flwr(*cmd[1:], timeout=timeout)
        lines = []
        with subprocess.Popen(
            cmd, env=self.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            assert proc.stdout is not None
            timer = threading.Timer(timeout, proc.kill)  # the stream ends when the process does
            timer.start()
            try:
                for line in proc.stdout:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    lines.append(line)
            finally:
                timer.cancel()
            code = proc.wait()
        return subprocess.CompletedProcess(cmd, code, "".join(lines), "")

    def up(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)
        self.make_credentials()
        self.start_superlink()
        self.start_gateway()
        self.write_connection()
        for name in self.names:
            reg = self.register(name)
            if reg.returncode != 0:
                raise RuntimeError(f"registering SuperNode {name} failed:\n{reg.stdout}\n{reg.stderr}")
        for name in self.names:
            self.start_supernode(name)

    def _wait_for_port(self, host: str, port: int, name: str, timeout: float = 60) -> None:
        import socket

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode}:\n{self.log_text(name)[-3000:]}")
            with socket.socket() as s:
                if s.connect_ex((host, port)) == 0:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"{name} did not open port {port} within {timeout:.0f} s:\n{self.log_text(name)[-3000:]}")

    def __enter__(self) -> LocalFederation:
        try:
            self.up()
        except BaseException:
            self.stop_all()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def _rounds(stdout: str) -> tuple[str, list[dict]]:
    """(status, per-round seconds and client counts) from the run folder the ServerApp named."""
    found = re.findall(r"run folder: (\S+)", stdout)
    results = Path(found[-1]) / "results.json" if found else None
    if results is None or not results.exists():
        return "no results", []
    data = json.loads(results.read_text())
    return data["run"]["status"], [
        {
            "round": r["round"],
            "seconds": r.get("seconds"),
            TRAIN_CLIENTS: r["metrics"].get(TRAIN_CLIENTS),
            "evaluate-clients": r["metrics"].get(EVAL_CLIENTS),
            "asked-again": len(r.get("asked_again", [])),
            "missing": len(r.get("missing", [])),
        }
        for r in data["rounds"]
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.local_federation", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True, help="credentials, Flower state, logs")
    p.add_argument("--supernodes", type=int, default=2)
    p.add_argument(
        "--node-config",
        action="append",
        default=[],
        help="node config of the i-th SuperNode (repeatable; default: partition-id=i num-partitions=N)",
    )
    p.add_argument("--run-config", default="", help="run-config overrides passed to flwr run")
    p.add_argument(
        "--report",
        type=Path,
        help="write a JSON report here: the federation's peak memory per program and each round's time",
    )
    p.add_argument(
        "--workers",
        action="store_true",
        help="start a warm node worker beside each SuperNode (python -m fedvlm.deploy.node_worker)",
    )
    p.add_argument("--cache-dir", type=Path, help="the organisations' cache (default: each node's own)")
    p.add_argument(
        "--no-database",
        action="store_true",
        help="keep the SuperLink's state in its memory instead of an SQLite file (lost if the SuperLink restarts)",
    )
    return p


def _write_report(args: argparse.Namespace, proc, mem: TreeMemory, lost: int, t0: float, started: float) -> None:
    """``--report``: the federation's peak memory per program and each round's time, as JSON and
    in words."""
    status, rounds = _rounds(proc.stdout)
    report = {
        "supernodes": args.supernodes,
        "workers": args.workers,
        "database": not args.no_database,
        "run_config": args.run_config,
        "status": status,
        "setup_seconds": round(started - t0, 1),
        "run_seconds": round(time.time() - started, 1),
        "rounds": rounds,
        "replies_lost_in_transit": lost,
        "peak_rss_mib": round(mem.peak_rss_mib),
        "peak_pss_mib": round(mem.peak_pss_mib),
        "peak_by_program": mem.peak_by_program,
        "cpus": os.cpu_count(),
    }
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2))
    print(
        f"\n{args.supernodes} SuperNodes: {status}; peak memory {mem.peak_pss_mib / 1024:.1f} GiB PSS "
        f"({mem.peak_rss_mib / 1024:.1f} GiB RSS); "
        + ", ".join(
            (
                f"round {r['round']} {r['seconds']:.0f} s ({r[TRAIN_CLIENTS]} trained, "
                f"{r['asked-again']} asked again, {r['missing']} missing)"
            )
            for r in rounds
        )
        + f"; {lost} replies lost in transit; report: {args.report}"
    )
    for name, row in mem.peak_by_program.items():
        print(
            f"  {name:<20} {row['processes']:>3.0f} processes  {row['pss_mib']:>8.0f} MiB PSS  "
            f"{row['rss_mib']:>8.0f} MiB RSS"
        )


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    names = [f"org-{i}" for i in range(args.supernodes)]
    configs = {
        n: (args.node_config[i] if i < len(args.node_config) else f"partition-id={i} num-partitions={args.supernodes}")
        for i, n in enumerate(names)
    }
    t0 = time.time()
    fed_ = LocalFederation(
        args.workdir,
        names,
        configs,
        workers=names if args.workers else (),
        database=not args.no_database,
        cache_dir=args.cache_dir,
    )
    with fed_ as fed, TreeMemory(str(fed.dir), 1.0) as mem:
        print(
            f"SuperLink on {HOST}:{fed.port} (TLS, SuperNode auth; its Fleet gateway on {PUBLIC}:{fed.gateway_port}), "
            f"SuperNodes: {', '.join(names)}, pinned to app sha256 {fed.pins[0][:12]}; "
            f"PIDs {json.dumps(fed.pids())}; logs in {fed.dir / 'logs'}",
            flush=True,
        )
        started = time.time()
        proc = fed.run_app(args.run_config, echo=True)
        lost = fed.lost_replies()
    if args.report:
        _write_report(args, proc, mem, lost, t0, started)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
