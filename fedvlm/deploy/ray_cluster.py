"""A Ray cluster of several nodes on this machine's loopback, started the way docs/simulation-cluster.md
starts one over several machines (``ray start --head``, then ``ray start --address=HEAD`` per
worker), for the test and the benchmark of a multi-node simulation.

Each node is its own raylet with its own resources and environment (a worker's ``FEDVLM_CACHE``
plays another machine's disk), all on 127.0.0.2: Ray turns 127.0.0.1 into the machine's external
address when it forms a cluster (``ray._private.services.resolve_ip_for_localhost``), and any other
loopback address keeps the cluster on loopback. Ray's servers still listen on every interface, as
they do on a real cluster. The cluster's files live in its own short temporary directory (Unix
socket paths are limited to 107 bytes), so it never becomes the cluster that a plain ``ray.init()``
elsewhere on the machine attaches to, and every process it starts is found there and stopped by PID.

    python -m fedvlm.deploy.ray_cluster --cpus 1,1 -- \
        flwr run . --federation-config "num-supernodes=10 client-resources-num-cpus=1"
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedvlm.utils.processes import cmdline, flwr_env, free_port, kill_tree, pids_matching, start_local_superlink

HOST = "127.0.0.2"
RAY = str(Path(sys.executable).with_name("ray"))
CLIENT_TASK = "ray::ClientAppActor.run"  # the title of a Ray worker while Flower's actor runs a ClientApp


@dataclass(frozen=True)
class RayNode:
    """One node's share of the machine: its CPUs and GPUs, and the environment its workers see."""

    cpus: int
    gpus: int = 0
    env: Mapping[str, str] = field(default_factory=dict)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


class LoopbackRayCluster:
    """``with LoopbackRayCluster([RayNode(1), RayNode(1)]) as cluster:`` a head and one worker;
    ``cluster.env()`` points ``flwr run`` (its SuperLink, hence the simulation's ``ray.init()``) at it."""

    def __init__(self, nodes: Sequence[RayNode], host: str = HOST) -> None:
        if not nodes:
            raise ValueError("a Ray cluster needs at least its head node")
        self.nodes, self.host = list(nodes), host
        self.port = free_port()
        self.temp = Path(tempfile.mkdtemp(prefix="ray-"))
        self.raylets: list[int] = []  # the raylet of each node, in the order of ``nodes``

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """What a process needs to attach its ``ray.init()`` to this cluster (on Linux, Ray forms
        clusters unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which ``utils.processes.flwr_env`` sets
        for one-machine simulations)."""
        return {"RAY_ADDRESS": self.address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}

    def _start(self, node: RayNode, head: bool) -> None:
        role = (
            ["--head", f"--port={self.port}", f"--temp-dir={self.temp}", "--include-dashboard=false"]
            if head
            else [f"--address={self.address}"]
        )
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **self.env(), **node.env)
        env.pop("RAY_ADDRESS")  # `ray start` takes the address from its arguments
        before = set(self._raylets())
        proc = subprocess.run(
            [RAY, "start", *role, f"--node-ip-address={self.host}", f"--num-cpus={node.cpus}"]
            + [f"--num-gpus={node.gpus}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            log = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"`ray start` of node {len(self.raylets)} failed:\n{log}")
        (raylet,) = set(self._raylets()) - before
        self.raylets.append(raylet)

    def _raylets(self) -> list[int]:
        return [p for p in pids_matching(str(self.temp)) if "/raylet/raylet " in cmdline(p)]

    def __enter__(self) -> LoopbackRayCluster:
        try:
            for i, node in enumerate(self.nodes):
                self._start(node, head=i == 0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Every process of the cluster, by PID (``ray stop`` would stop every Ray on the machine)."""
        for _ in range(3):  # a raylet may start a worker while its siblings are being stopped
            for pid in pids_matching(str(self.temp)):
                kill_tree(pid)
            if not pids_matching(str(self.temp)):
                break
        shutil.rmtree(self.temp, ignore_errors=True)

    def client_tasks(self) -> dict[int, int]:
        """For each node (by its index in ``nodes``), how many Ray workers run a ClientApp now."""
        busy = dict.fromkeys(range(len(self.raylets)), 0)
        for pid in pids_matching(CLIENT_TASK):
            if cmdline(pid).startswith(CLIENT_TASK) and _parent(pid) in self.raylets:
                busy[self.raylets.index(_parent(pid))] += 1
        return busy


class TaskWatch:
    """Samples ``cluster.client_tasks()`` while a run goes on: on which nodes ClientApps ran."""

    def __init__(self, cluster: LoopbackRayCluster, every: float = 0.2) -> None:
        self.cluster, self.every = cluster, every
        self.seen = dict.fromkeys(range(len(cluster.nodes)), 0)  # samples that caught a ClientApp on each node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            for node, busy in self.cluster.client_tasks().items():
                self.seen[node] += busy

    def __enter__(self) -> TaskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", default="1,1", help="CPUs of each node, head first (one number per node)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command to run against the cluster")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("name the command to run against the cluster after --")
    with LoopbackRayCluster([RayNode(int(c)) for c in args.cpus.split(",")]) as cluster, TaskWatch(cluster) as watch:
        print(f"Ray cluster at {cluster.address}: {len(cluster.nodes)} nodes, CPUs {args.cpus}", flush=True)
        home = cluster.temp / "flwr-home"  # its own local SuperLink, started with the cluster's address
        started = time.time()
        env = dict(flwr_env(home), **cluster.env())
        try:
            start_local_superlink(env)  # with a bound of its own, not Flower's CLI's 15 s
            rc = subprocess.run(command, env=env).returncode
        finally:
            for pid in pids_matching(str(home)):
                kill_tree(pid)
        print(f"{time.time() - started:.1f} s; ClientApps seen running per node: {watch.seen}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
