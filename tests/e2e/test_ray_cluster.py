"""A simulation on a multi-node Ray cluster, as docs/simulation-cluster.md runs one: a head and a
worker node started by ``ray start`` on loopback (``deploy.ray_cluster``), each with one CPU and
its own cache (as another machine has its own disk), ``flwr run`` attached to the cluster, and
one CPU per ClientApp, so that every node runs clients. The run ends with the metrics of the same
run on one node."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fedvlm.deploy.ray_cluster import LoopbackRayCluster, RayNode, TaskWatch
from fedvlm.utils.processes import flwr_env, flwr_run, kill_tree, pids_matching

CONFIG = "method='promptfl' num-server-rounds=2 seed=3 run-name='r' output-dir='{out}'"
FEDERATION = "client-resources-num-cpus=1"


def _run(env: dict, run_config: str, home) -> dict:
    try:
        proc = flwr_run(env, run_config, supernodes=4, federation=FEDERATION, timeout=1200)
    finally:
        for pid in pids_matching(str(home)):
            kill_tree(pid)
    path = Path(run_config.split("output-dir='")[1].split("'")[0]) / "r" / "results.json"
    data = json.loads(path.read_text()) if path.exists() else None
    assert data is not None and data["run"]["status"] == "finished", (proc.stdout + proc.stderr)[-4000:]
    return data


def _learning(data: dict) -> list[dict]:
    """Each round's figures but its timings."""
    return [{k: v for k, v in r["metrics"].items() if "seconds" not in k} for r in data["rounds"]]


def _models_only(cache_dir, to):
    shutil.copytree(cache_dir / "models", to / "models")  # what docs/simulation-cluster.md has copied to each node
    return to


def test_two_ray_nodes_both_run_clients_and_end_with_the_one_node_metrics(tmp_path, cache_dir, pretrained_clip):
    head_cache = _models_only(cache_dir, tmp_path / "head-cache")
    worker_cache = _models_only(cache_dir, tmp_path / "worker-cache")
    server_cache = _models_only(cache_dir, tmp_path / "server-cache")
    nodes = [RayNode(1, env={"FEDVLM_CACHE": str(head_cache)}), RayNode(1, env={"FEDVLM_CACHE": str(worker_cache)})]
    home = tmp_path / "flwr-cluster"
    with LoopbackRayCluster(nodes) as cluster, TaskWatch(cluster) as watch:
        # no cache-dir in the run config: each process caches where its own machine says
        env = dict(flwr_env(home), FEDVLM_CACHE=str(server_cache), **cluster.env())
        clustered = _run(env, CONFIG.format(out=tmp_path / "cluster"), home)
    assert not pids_matching(str(cluster.temp)), "a Ray process of the cluster survived"
    assert watch.seen[0] > 0 and watch.seen[1] > 0, watch.seen  # ClientApps ran on the head and on the worker
    # each node's clients encoded their images into that node's own cache
    assert list((head_cache / "features").glob("*.pt")) and list((worker_cache / "features").glob("*.pt"))

    home = tmp_path / "flwr-one"
    alone = _run(flwr_env(home), CONFIG.format(out=tmp_path / "one") + f" cache-dir='{cache_dir}'", home)
    assert _learning(clustered) == _learning(alone) and len(clustered["rounds"]) == 2
