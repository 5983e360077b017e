"""The deployment path on loopback: a SuperLink with TLS and SuperNode authentication on
127.0.0.1, its Fleet gateway on 127.0.0.2 (the federation's public address here) and SuperNodes
that run only the pinned app, as separate processes (deploy.local_federation, the steps of
docs/deployment.md), run the embedded default through `flwr run`; an outsider with the public
CA certificate is refused at every step; every process is stopped by PID at the end, also when
a test fails."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fedvlm.utils.processes import pids_matching

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


# ---- a real federation on loopback ---------------------------------------------------------


@pytest.fixture(scope="module")
def federation(tmp_path_factory, cache_dir, pretrained_clip):
    from fedvlm.deploy.local_federation import LocalFederation

    work = tmp_path_factory.mktemp("federation")
    fed = LocalFederation(
        work,
        ["org-0", "org-1"],
        {"org-0": "partition-id=0 num-partitions=2", "org-1": "partition-id=1 num-partitions=2"},
        workers=["org-1"],  # one organisation with a warm node worker, one without: both paths
    )
    with fed:
        fed.make_credentials(extra=["org-own", "org-bad", "intruder"])  # keys made, not registered
        _wait_online(fed, 2)
        yield fed
    assert not pids_matching(str(work)), "a Flower process of the federation survived the test"


def _nodes(fed) -> list[dict]:
    proc = fed.flwr("supernode", "list", "loopback", "--format", "json", timeout=60)
    return json.loads(proc.stdout)["nodes"] if proc.returncode == 0 else []


def _wait_online(fed, n: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if sum(node["status"] == "online" for node in _nodes(fed)) >= n:
            return
        time.sleep(1)
    raise AssertionError(
        f"fewer than {n} SuperNodes online after {timeout} s: {_nodes(fed)}\n"
        + "\n".join(fed.log_text(name)[-1500:] for name in fed.procs)
    )


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if "seconds" not in k}


@pytest.mark.ci
def test_deployment_with_tls_and_auth_matches_the_simulation(federation, flwr_env, tmp_path, cache_dir):
    common = f"num-server-rounds=2 cache-dir='{cache_dir}' round-timeout=120 run-name='r'"
    dep = federation.run_app(f"{common} output-dir='{tmp_path / 'deployed'}'", timeout=900)
    log = dep.stdout + dep.stderr
    path = tmp_path / "deployed" / "r" / "results.json"
    assert path.exists(), log[-4000:]
    deployed = json.loads(path.read_text())
    assert deployed["run"]["status"] == "finished", log[-3000:]
    assert sorted(n["name"] for n in deployed["run"]["nodes"]) == ["client-0", "client-1"]
    assert "[round 2/2]" in log
    for org in ("org-0", "org-1"):  # every ClientApp was forked from its SuperExec's fork server
        exec_log = federation.log_text(f"{org}-exec")
        assert "forked from a warm fork server" in exec_log and "fork server is gone" not in exec_log, exec_log[-3000:]

    sim = subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            str(ROOT),
            "--stream",
            "--federation-config",
            "num-supernodes=2",
            "--run-config",
            f"{common} output-dir='{tmp_path / 'simulated'}'",
        ],
        env=flwr_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    path = tmp_path / "simulated" / "r" / "results.json"
    assert path.exists(), (sim.stdout + sim.stderr)[-4000:]
    simulated = json.loads(path.read_text())
    # Parity: the same config and seed give the same per-round numbers. Sampling is seeded over
    # node names (not Flower's random node ids), every node derives its partition and its
    # generators from the seed, and on the CPU the arithmetic is the same in a Ray worker and
    # in a SuperNode's ClientApp process.
    for d, s in zip(deployed["rounds"], simulated["rounds"], strict=True):
        dm, sm = _untimed(d["metrics"]), _untimed(s["metrics"])
        assert dm.keys() == sm.keys()
        for k in dm:
            assert dm[k] == pytest.approx(sm[k], rel=1e-6, abs=1e-9), (d["round"], k)
        assert d["bytes"] == s["bytes"]
    assert _untimed(deployed["final"]) == pytest.approx(_untimed(simulated["final"]))
    # org-1's messages ran in its warm worker: the handshake, round 1's training, round 2's
    # (carrying round 1's evaluation) and round 2's evaluation
    assert federation.log_text("org-1-worker").count("served ") >= 4, federation.log_text("org-1-worker")[-2000:]


def test_an_unregistered_supernode_is_refused(federation):
    proc = federation.start_supernode("intruder", "partition-id=0 num-partitions=2", retry_for=0)
    try:
        code = proc.wait(timeout=120)
    finally:
        federation.stop("intruder")
    assert code != 0
    assert "Failed to activate SuperNode" in federation.log_text("intruder")
    assert len(_nodes(federation)) == 2  # still only the two registered nodes


def test_own_data_nodes_join_and_a_killed_node_leaves_the_rounds_to_the_others(federation, tmp_path, cache_dir):
    from fedvlm.data.registry import load_image_folder
    from fedvlm.deploy.export_folder import export_partitions

    own = export_partitions(tmp_path / "org-data", 2)[0]
    for name in ("org-own", "org-bad"):
        reg = federation.register(name)
        assert reg.returncode == 0, reg.stdout + reg.stderr
    federation.start_supernode("org-own", f"data-dir='{own}' name='org-own'")
    federation.start_supernode("org-bad", f"data-dir='{tmp_path / 'no-such-folder'}' name='org-bad'")
    _wait_online(federation, 4)

    out = tmp_path / "runs"
    run = subprocess.Popen(
        [
            str(BIN / "flwr"),
            "run",
            str(ROOT),
            "loopback",
            "--stream",
            "--run-config",
            f"num-server-rounds=3 min-nodes=2 round-timeout=60 cache-dir='{cache_dir}' output-dir='{out}' run-name='k'",
        ],
        env=federation.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    results = out / "k" / "results.json"
    try:
        deadline = time.time() + 600
        while time.time() < deadline and run.poll() is None:
            if results.exists() and len(json.loads(results.read_text()).get("rounds", [])) >= 1:
                break
            time.sleep(0.5)
        federation.stop("org-1")  # an organisation's machine goes away during round 2
        log, _ = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
        # the module's later tests find the federation as it was: the two partition nodes
        federation.stop("org-own")
        federation.stop("org-bad")
        federation.start_supernode("org-1")
    data = json.loads(results.read_text())
    assert data["run"]["status"] == "finished", log[-4000:]
    nodes = {n["name"]: n for n in data["run"]["nodes"]}
    assert set(nodes) == {"client-0", "client-1", "org-own"}
    split = load_image_folder(own, 0.3)
    assert nodes["org-own"]["num_train"] == len(split.train) and nodes["org-own"]["partition_id"] == -1
    # the node whose folder is missing was excluded at the handshake with its own error
    assert any("no-such-folder" in r and "does not exist" in r for r in data["run"]["excluded_nodes"].values())
    trained = [r["metrics"]["train-clients"] for r in data["rounds"]]
    assert trained[0] == 3 and trained[-1] == 2, trained
    assert "client-1" not in data["rounds"][-1]["clients"]
    # the SuperLink answers for the dead node ("Node Unavailable"); the server names the node
    lost = [d for r in data["rounds"] for d in r["dropped"]]
    assert lost and all(d["client"] == "client-1" for d in lost), lost


# ---- an outsider: who may start a run, what a node will run ---------------------------------

OUTSIDER_APP = """\
import json
import pathlib
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client = ClientApp()
server = ServerApp()


@client.query()
def steal(msg: Message, context: Context) -> Message:
    # a benign proof: a real attacker would read the organisation's data, state and keys
    out = pathlib.Path(context.run_config["marker"]) / f"node-{context.node_id}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    seen = {k: str(v) for k, v in context.node_config.items()}
    out.write_text(json.dumps(seen))
    return Message(RecordDict({"config": ConfigRecord(seen)}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    deadline, nodes = time.time() + 60, []
    while time.time() < deadline and len(nodes) < 2:
        nodes = list(grid.get_node_ids())
        time.sleep(1)
    asks = [Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="query") for n in nodes]
    replies = [
        {"error": r.error.reason} if r.has_error() else dict(r.content["config"])
        for r in grid.send_and_receive(asks, timeout=120)
    ]
    out = pathlib.Path(context.run_config["marker"]) / "server.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(replies))
"""


def _outsider(tmp_path: Path, federation) -> tuple[Path, dict]:
    """The outsider's app, and its flwr environment: the public CA certificate and the address
    SuperNodes dial, nothing else."""
    from fedvlm.deploy.local_federation import PUBLIC

    app = tmp_path / "outsider"
    app.mkdir()
    (app / "outsider_app.py").write_text(OUTSIDER_APP)
    (app / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["hatchling"]
            build-backend = "hatchling.build"

            [project]
            name = "outsider"
            version = "1.0.0"
            description = "not the federation's app"
            license = "Apache-2.0"
            dependencies = ["flwr"]

            [tool.hatch.build.targets.wheel]
            packages = ["."]

            [tool.flwr.app]
            publisher = "outsider"

            [tool.flwr.app.components]
            serverapp = "outsider_app:server"
            clientapp = "outsider_app:client"

            [tool.flwr.app.config]
            marker = ""
            """
        )
    )
    home = tmp_path / "outsider-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "outsider"\n\n[superlink.outsider]\naddress = "{PUBLIC}:{federation.gateway_port}"\n'
        f'root-certificates = "{federation.creds / "ca.crt"}"\n'
    )
    return app, {**federation.env, "FLWR_HOME": str(home)}


@pytest.mark.ci
def test_an_outsider_starts_nothing_and_a_node_runs_only_the_app_it_pinned(federation, tmp_path):
    app, env = _outsider(tmp_path, federation)
    marker = tmp_path / "marker"
    intruder_key = federation.creds / "supernodes" / "intruder.pub"
    attempts = {
        "run": ["run", str(app), "outsider", "--run-config", f"marker='{marker}'"],
        "ls": ["ls", "outsider"],
        "log": ["log", "1", "outsider"],
        "stop": ["stop", "1", "outsider"],
        "supernode register": ["supernode", "register", str(intruder_key), "outsider", "--name", "intruder"],
        "supernode list": ["supernode", "list", "outsider"],
    }
    for what, args in attempts.items():
        proc = subprocess.run(
            [str(BIN / "flwr"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode != 0 and "403 Forbidden" in proc.stdout + proc.stderr, (what, proc.stdout, proc.stderr)
    refused = federation.log_text("gateway")
    for call in ("start-run", "list-runs", "stream-logs", "stop-run", "register-node", "list-nodes"):
        assert f"refused POST /v1/control/{call}" in refused, (call, refused[-3000:])
    assert not marker.exists()  # nothing of the outsider's app ran anywhere
    assert "intruder" not in json.dumps(_nodes(federation))  # its key was not registered

    # the same app through the Control API on the SuperLink host (a researcher, or whoever controls
    # that host): its ServerApp runs there, and every node refuses it before unpacking it
    run = federation.flwr("run", str(app), "loopback", "--stream", "--run-config", f"marker='{marker}'", timeout=300)
    replies = json.loads((marker / "server.json").read_text()) if (marker / "server.json").exists() else None
    assert replies is not None, run.stdout[-3000:] + run.stderr[-2000:]
    # a node an earlier test stopped may still count as connected: the SuperLink answers for it
    live = [r for r in replies if "Node Unavailable" not in r.get("error", "")]
    assert len(live) >= 2, replies
    for reply in live:
        assert "AppNotPinned" in reply.get("error", ""), reply
        assert federation.pins[0] in reply["error"] and "outsider/outsider 1.0.0" in reply["error"], reply
    assert sorted(p.name for p in marker.iterdir()) == ["server.json"]  # no node ran a line of it


@pytest.mark.ci
def test_what_the_deployment_writes_is_owner_only(federation):
    """Keys, secrets, the SuperLink's database, logs and the apps a node unpacked are readable by
    their owner alone (the processes run with umask 077); only certificates and public keys are
    not secret."""
    public = {"ca.crt", "server.crt"}
    exposed = [
        str(p.relative_to(federation.dir))
        for p in [federation.dir, *federation.dir.rglob("*")]
        if stat.S_IMODE(p.stat().st_mode) & 0o077 and p.suffix != ".pub" and p.name not in public
    ]
    assert not exposed, exposed


def test_fedrand_organisations_train_on_their_own_folders(federation, tmp_path, vlm_cache):
    """The own-data VLM format through a real deployment: two organisations' SuperNodes with their
    own folders of images and captions (data.jsonl) join a FedRand run beside the partition nodes."""
    from fedvlm.deploy.export_folder import export_partitions

    folders = export_partitions(tmp_path / "vlm-data", 2, {"method": "fedrand", "seed": 3})
    for i, folder in enumerate(folders):
        name = f"vlm-{i}"
        federation.make_credentials(extra=[name])
        reg = federation.register(name)
        assert reg.returncode == 0, reg.stdout + reg.stderr
        federation.start_supernode(name, f"data-dir='{folder}' name='{name}'")
    _wait_online(federation, 4)
    out = tmp_path / "runs"
    run = federation.run_app(
        f"method='fedrand' num-server-rounds=1 fraction-train=1.0 lora.local-steps=2 vlm.eval-samples=2 "
        f"vlm.max-new-tokens=8 min-nodes=4 round-timeout=600 cache-dir='{vlm_cache}' output-dir='{out}' run-name='v'",
        timeout=1200,
    )
    data = json.loads((out / "v" / "results.json").read_text())
    assert data["run"]["status"] == "finished", run.stdout[-4000:]
    nodes = {n["name"]: n for n in data["run"]["nodes"]}
    assert {"vlm-0", "vlm-1"} <= set(nodes) and nodes["vlm-0"]["partition_id"] == -1
    assert {"vlm-0", "vlm-1"} <= set(data["rounds"][0]["clients"])
    for i in range(2):
        federation.stop(f"vlm-{i}")
