"""The deployment path on loopback: a SuperLink with TLS and SuperNode authentication on
127.0.0.1, its Fleet gateway on 127.0.0.2 (the federation's public address here) and SuperNodes
that run only the pinned app, as separate processes (deploy.local_federation, the steps of
docs/deployment.md), run the embedded default through `flwr run`; an outsider with the public
CA certificate is refused at every step; every process is stopped by PID at the end, also when
a test fails."""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
import tempfile
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
        cache_dir=cache_dir,  # the organisations' own cache (a run config's cache-dir is the server's)
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
    # every message travelled with its objects and confirmations (deploy.whole_messages, object_batches)
    calls = re.findall(r" ([a-z-]+) (\d{3}) in ", federation.log_text("gateway"))
    assert ("pull-message", "200") in calls and ("push-message", "200") in calls, calls[-40:]
    singles = {"pull-messages", "push-messages", "confirm-message-received", "pull-object", "push-object"}
    assert not {c for c, _ in calls} & singles, calls[-40:]

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


def _run_past_round_one(federation, run_config: str, results: Path, timeout: float = 600) -> subprocess.Popen:
    """`flwr run` of this checkout, going on in the background once its first round is recorded."""
    run = subprocess.Popen(
        [str(BIN / "flwr"), "run", str(ROOT), "loopback", "--stream", "--run-config", run_config],
        env=federation.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + timeout
    while time.time() < deadline and run.poll() is None:
        if results.exists() and json.loads(results.read_text()).get("rounds"):
            return run
        time.sleep(0.5)
    run.kill()
    raise AssertionError(f"no round recorded in {results}:\n{run.communicate()[0][-3000:]}")


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
    results = out / "k" / "results.json"
    config = f"num-server-rounds=3 min-nodes=2 round-timeout=60 cache-dir='{cache_dir}' output-dir='{out}' run-name='k'"
    run = _run_past_round_one(federation, config, results)
    try:
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
    # it trains in no round after its machine went away (the SuperLink may still list it as
    # connected when the next round starts: its message is then answered 'Node Unavailable')
    assert "train/num-examples" not in data["rounds"][-1]["clients"].get("client-1", {})
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


AGENT_OUTSIDER = """\
import json
import os
import pathlib
import time

from flwr.agentapp import AgentApp, AgentSession
from flwr.app import Context

app = AgentApp()
MARKER = pathlib.Path(MARKER_DIR)
# importing this module is already running its code: leave a trace, with the runtime API it serves
MARKER.mkdir(parents=True, exist_ok=True)
(MARKER / f"imported-{os.getpid()}").write_text(" ".join(__import__("sys").argv))


def _call(agent, name, **arguments):
    call = {"type": "function_call", "call_id": f"{name}-{time.time_ns()}", "name": name}
    out = agent.grid.call({**call, "arguments": json.dumps(arguments)})
    return json.loads(out["output"])


@app.main()
def main(agent: AgentSession, context: Context) -> None:
    if context.node_id != 1:  # on a SuperNode: a benign proof that it ran there
        (MARKER / f"ran-on-{context.node_id}").write_text(agent.prompt)
        _call(agent, "push_reply_message", payload="ran")
        return
    nodes = _call(agent, "get_nodes", sample_size=None)["nodes"]
    pushed = _call(
        agent, "push_messages", messages=[{"dst_node_id": n["id"], "payload": agent.prompt} for n in nodes]
    )["results"]
    ids = [r["message_id"] for r in pushed if r["message_id"]]
    replies = _call(agent, "pull_messages", message_ids=ids, timeout=60)
    agent.events.emit({"type": "response.output_text.delta", "delta": json.dumps(replies)})
    agent.events.emit({"type": "response.completed"})
"""

SUBMIT_CHAT = """\
import json, sys
from pathlib import Path
from flwr.cli.chat.chat_app import start_chat_run, parse_task_event
from flwr.cli.chat.chat_local_agent import build_local_agent
from flwr.cli.flower_config import read_superlink_connection
from flwr.cli.utils import init_http_client_from_connection
from flwr.proto.control_pb2 import StreamRunEventsRequest

conn = read_superlink_connection(sys.argv[2])
stub = init_http_client_from_connection(conn)
agent = build_local_agent(Path(sys.argv[1]))
fab = (agent.app_spec, agent.fab_hash, agent.fab_content)
run_id, _ = start_chat_run(stub, "hello nodes", conn.federation, None, *fab)
for res in stub.StreamRunEvents(StreamRunEventsRequest(run_id=run_id)):
    print(json.dumps(parse_task_event(res.task_event), default=str), flush=True)
"""


def _agent_outsider(tmp_path: Path, marker: Path) -> Path:
    """The outsider's app as an AgentApp (as `flwr chat` loads one): no ClientApp at all."""
    app = tmp_path / "agent-outsider"
    (app / "agent_outsider").mkdir(parents=True)
    (app / "agent_outsider" / "__init__.py").write_text("")
    (app / "agent_outsider" / "app.py").write_text(AGENT_OUTSIDER.replace("MARKER_DIR", repr(str(marker))))
    (app / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [project]
            name = "agent-outsider"
            version = "1.0.0"
            description = "not the federation's app"
            license = "Apache-2.0"
            dependencies = []

            [tool.flwr.app]
            publisher = "outsider"

            [tool.flwr.app.components]
            agentapp = "agent_outsider.app:app"

            [tool.flwr.app.config]
            """
        )
    )
    return app


@pytest.mark.ci
def test_an_agentapp_form_of_the_outsider_is_refused_by_every_node(federation, tmp_path):
    """Flower's SuperExec serves every task type: a FAB declaring an ``agentapp`` component makes an
    AgentApp run, which a node would install and import with Flower's own ``flwr-agentapp``. Every
    node's SuperNode refuses the run before it stores anything of it (deploy.supernode_gate)."""
    marker = tmp_path / "marker"
    app = _agent_outsider(tmp_path, marker)
    submit = tmp_path / "submit.py"
    submit.write_text(SUBMIT_CHAT)
    run = subprocess.run(
        [sys.executable, str(submit), str(app), "loopback"],
        env=federation.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    events = run.stdout + run.stderr
    assert "NotAClientApp" in events, events[-3000:]  # each node's refusal, as the submitter reads it
    for org in ("org-0", "org-1"):
        assert "NotAClientApp" in federation.log_text(org), federation.log_text(org)[-2000:]
        assert "flwr-agentapp" not in federation.log_text(f"{org}-exec")
    # its code ran only where the researcher's code runs, on the SuperLink host: the submitter's
    # side of the AgentApp, started by the SuperLink's own SuperExec; on no node
    imported = [p.read_text() for p in marker.glob("imported-*")]
    assert imported and all(f"127.0.0.1:{federation.port}" in argv for argv in imported), imported
    assert not list(marker.glob("ran-on-*"))


def test_other_accounts_on_the_superlink_host_reach_nothing(federation, tmp_path):
    """Every local account but the operator's is refused by the SuperLink itself (deploy.superlink):
    the Control API, and taking the ServerApp's tasks."""
    import os

    if os.getuid() != 0:
        pytest.skip("switching to another account needs root")
    # the other account's own files: a connection to the SuperLink and the public CA certificate
    home = Path(tempfile.mkdtemp(prefix="fedvlm-nobody-"))
    try:
        home.chmod(0o755)
        shutil.copy(federation.creds / "ca.crt", home / "ca.crt")
        (home / "config.toml").write_text(
            (federation.home / "config.toml")
            .read_text()
            .replace(str(federation.creds / "ca.crt"), str(home / "ca.crt"))
        )
        for f in home.iterdir():
            f.chmod(0o644)
        proc = subprocess.run(
            ["su", "nobody", "-s", "/bin/sh", "-c", f"FLWR_HOME={home} {BIN / 'flwr'} ls loopback"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(home)
    assert proc.returncode != 0 and "403" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "the calling socket belongs to uid 65534" in federation.log_text("superlink")


@pytest.mark.ci
def test_what_the_deployment_writes_is_owner_only(federation):
    """Keys, secrets, the SuperLink's database, logs and the apps a node unpacked are readable by
    their owner alone (the processes run with umask 077); only certificates and public keys (the
    roster is the members' public keys) are not secret."""
    public = {"ca.crt", "server.crt", "roster.json"}
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


def _node_id(federation, name: str, wait: float = 120.0) -> int:
    """The node id ``name``'s SuperNode logged (waiting for it: another test's stopped SuperNodes
    may still count as online at the SuperLink while this one connects)."""
    deadline = time.time() + wait
    while not (found := re.findall(r"SuperNode ID: (\d+)", federation.log_text(name))) and time.time() < deadline:
        time.sleep(1)
    assert found, federation.log_text(name)[-2000:]
    return int(found[-1])


def _forge(federation, address: str, attacker: str, victim: int, run_id: int) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "e2e" / "hostile_node" / "forge_instruction.py"),
            address,
            str(federation.creds / "ca.crt"),
            str(federation.creds / "supernodes" / attacker),
            str(_node_id(federation, attacker)),
            str(victim),
            str(run_id),
        ],
        env=federation.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_organisation_cannot_instruct_another_and_a_nodes_limit_spans_its_runs(federation, tmp_path, cache_dir):
    """org-0 pushes a train message "from the SuperLink" to a node with a privacy limit while a run
    is going: the gateway refuses the push; pushed past the gateway (from the SuperLink host), the
    victim pulls it and its ClientApp refuses it as unsigned, before the app runs, so it spends
    nothing. A second run at the same epsilon on the same records is then refused by that node at
    the handshake, with the epsilon its records spent in the first. A run config that names a path
    of the nodes' machines is refused by every node at the handshake, naming the key (the model and
    remote-code keys, which the server loads itself first: tests/unit/test_node_policy.py)."""
    from fedvlm.deploy.export_folder import export_partitions
    from fedvlm.deploy.local_federation import HOST, PUBLIC

    own = export_partitions(tmp_path / "org-data", 2)[0]
    state = tmp_path / "org-lim-state"
    federation.make_credentials(extra=["org-lim"])
    reg = federation.register("org-lim")
    assert reg.returncode == 0, reg.stdout + reg.stderr
    federation.start_supernode(
        "org-lim", f"data-dir='{own}' name='org-lim' max-epsilon=3 delta=1e-5 state-dir='{state}'"
    )
    try:
        _wait_online(federation, 3)
        victim = _node_id(federation, "org-lim")
        out = tmp_path / "runs"
        common = f"method='promptfl' privacy.epsilon=2.9 round-timeout=120 cache-dir='{cache_dir}'"
        results = out / "first" / "results.json"
        config = f"{common} num-server-rounds=3 min-nodes=3 output-dir='{out}' run-name='first'"
        run = _run_past_round_one(federation, config, results)
        run_id = int(json.loads(results.read_text())["run"]["run_id"])
        through_gateway = _forge(federation, f"{PUBLIC}:{federation.gateway_port}", "org-0", victim, run_id)
        assert not through_gateway["pushed"] and through_gateway["status"] == 403, through_gateway
        assert "pushed a message from node 1" in through_gateway["text"]
        assert "refused push-messages from 127.0.0.2" not in federation.log_text("gateway")  # logged by real peer
        assert "pushed a message from node 1" in federation.log_text("gateway")
        past_gateway = _forge(federation, f"{HOST}:{federation.port}", "org-0", victim, run_id)
        assert past_gateway["pushed"], past_gateway  # Flower's SuperLink takes it
        log, _ = run.communicate(timeout=900)
        first = json.loads(results.read_text())
        assert first["run"]["status"] == "finished", log[-3000:]
        refused = federation.log_text("org-lim-exec")
        assert "UnsignedInstruction" in refused and "carries no signature" in refused, refused[-3000:]
        (ledger,) = (state / "ledgers").glob("*.json")
        rows = json.loads(ledger.read_text())["rows"]
        trained = sum("org-lim" in r["clients"] for r in first["rounds"])
        assert len(rows) == trained == 3  # the forged message spent nothing

        second = federation.run_app(f"{common} num-server-rounds=1 min-nodes=2 output-dir='{out}' run-name='second'")
        assert (out / "second" / "results.json").exists(), second.stdout[-3000:] + second.stderr[-2000:]
        data = json.loads((out / "second" / "results.json").read_text())
        assert data["run"]["status"] == "finished", second.stdout[-3000:]
        why = " ".join(data["run"]["excluded_nodes"].values())
        assert "have spent epsilon = 2.9" in why and "1 earlier run(s)" in why, data["run"]["excluded_nodes"]
        assert len(json.loads(ledger.read_text())["rows"]) == 3

        # a path of the node's machine named by the run config (the server's own copy loads fine)
        code = federation.run_app(
            f"dataset='image-folder' data-root='{own.parent}' min-nodes=1 round-timeout=20 cache-dir='{cache_dir}' "
            f"output-dir='{out}' run-name='paths'"
        )
        assert (out / "paths" / "results.json").exists(), code.stdout[-3000:] + code.stderr[-2000:]
        run = json.loads((out / "paths" / "results.json").read_text())["run"]
        # every node refused it at the handshake, naming the key; with none left the run stops there
        assert run["status"] == "failed" and "run config 'data-root'" in run["note"], run
        assert "this node reads only its node config's data-dir" in run["note"]
        for org in ("org-0", "org-1", "org-lim"):
            assert str(_node_id(federation, org)) in run["note"], (org, run["note"])
    finally:
        federation.stop("org-lim")
