"""Faults in a real deployment on loopback (deploy.local_federation: a SuperLink with TLS and
SuperNode authentication, SuperNodes as processes, all stopped by PID): a SuperNode restarted
mid-run rejoins and goes on with its private state from its state directory; a SuperLink killed
mid-run (and its ServerApp with it) restarts on its database and the run resumes from its run
folder to the end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedvlm.utils.processes import pids_matching

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NODES = ("org-0", "org-1")


@pytest.fixture
def federation(tmp_path, cache_dir, pretrained_clip):
    from fedvlm.deploy.local_federation import LocalFederation

    state = tmp_path / "node-state"
    fed = LocalFederation(
        tmp_path / "fed",
        list(NODES),
        {n: f"partition-id={i} num-partitions=2 state-dir='{state / n}'" for i, n in enumerate(NODES)},
        cache_dir=cache_dir,
    )
    with fed:
        _wait_online(fed, 2)
        yield fed
    assert not pids_matching(str(tmp_path / "fed")), "a Flower process of the federation survived the test"


def _online(fed) -> int:
    proc = fed.flwr("supernode", "list", "loopback", "--format", "json", timeout=60)
    nodes = json.loads(proc.stdout)["nodes"] if proc.returncode == 0 else []
    return sum(node["status"] == "online" for node in nodes)


def _wait_online(fed, n: int, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _online(fed) >= n:
            return
        time.sleep(1)
    raise AssertionError(f"fewer than {n} SuperNodes online after {timeout} s\n" + fed.log_text("superlink")[-2000:])


def _start_run(fed, run_config: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "flwr"), "run", str(ROOT), "loopback", "--stream", "--run-config", fed.run_config(run_config)],
        env=fed.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_rounds(results: Path, n: int, run: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and run.poll() is None:
        if results.exists() and len(json.loads(results.read_text()).get("rounds", [])) >= n:
            return
        time.sleep(0.3)
    raise AssertionError(f"the run did not reach round {n}: {run.poll()}")


def _trained(data: dict, client: str) -> list[tuple[int, int]]:
    """(round, rounds-trained the node reported) for every round ``client`` trained in."""
    return [
        (r["round"], r["clients"][client]["train/rounds-trained"])
        for r in data["rounds"]
        if "train/rounds-trained" in r["clients"].get(client, {})
    ]


# out of CI (60 s): the TLS deployment test keeps a real SuperLink/SuperNode run there; `pytest -m slow` runs it
def test_a_restarted_supernode_rejoins_with_its_private_state(federation, tmp_path, cache_dir):
    out = tmp_path / "runs"
    run = _start_run(
        federation,
        f"method='coop' num-server-rounds=5 min-nodes=1 round-timeout=180 cache-dir='{cache_dir}' "
        f"output-dir='{out}' run-name='restart'",
    )
    results = out / "restart" / "results.json"
    try:
        _wait_rounds(results, 1, run)
        federation.stop("org-1")  # its machine goes down after round 1
        _wait_rounds(results, 2, run)
        federation.start_supernode("org-1")  # and comes back: same key, same node config
        log, _ = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    data = json.loads(results.read_text())
    assert data["run"]["status"] == "finished", log[-4000:]
    trained = _trained(data, "client-1")
    # it missed a round while down, trained again after the restart, and counted on from the
    # state it had written before (a node that lost its state would report 1 again). A round it
    # trained in just before it was stopped counts too, though its reply never arrived
    assert trained[0] == (1, 1) and len(trained) < 5 and trained[-1][0] == 5, trained
    counts = [count for _, count in trained]
    assert counts == sorted(set(counts)), trained  # strictly increasing
    assert all(count <= rnd for rnd, count in trained), trained
    assert _trained(data, "client-0") == [(r, r) for r in range(1, 6)]


def test_a_killed_superlink_restarts_on_its_database_and_the_run_resumes(federation, tmp_path, cache_dir):
    out = tmp_path / "runs"
    config = f"method='coop' num-server-rounds=3 round-timeout=180 cache-dir='{cache_dir}' output-dir='{out}'"
    run = _start_run(federation, f"{config} run-name='cut'")
    results = out / "cut" / "results.json"
    try:
        _wait_rounds(results, 1, run)
        federation.stop("superlink")  # the SuperLink and the ServerApp it runs die mid-run
        run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    # the ServerApp, stopped with its SuperLink, recorded that it was interrupted (or had no time to)
    assert json.loads(results.read_text())["run"]["status"] in ("interrupted", "running")
    status = subprocess.run([sys.executable, "-m", "fedvlm.status", str(out / "cut")], capture_output=True, text=True)
    assert status.returncode == 5, status.stdout

    federation.start_superlink()  # same port, same --database: the registered SuperNodes reconnect
    _wait_online(federation, 2)
    resumed = federation.run_app(f"{config} resume='{out / 'cut'}'", timeout=900)
    data = json.loads(results.read_text())
    assert data["run"]["status"] == "finished", resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert [r["round"] for r in data["rounds"]] == [1, 2, 3] and data["run"]["resumed"][0]["from_round"] >= 1
    for client in ("client-0", "client-1"):  # new ClientApp processes, the nodes' state from their disks
        assert _trained(data, client) == [(r, r) for r in range(1, 4)], client
    ok = subprocess.run([sys.executable, "-m", "fedvlm.status", str(out / "cut")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout


def test_a_crashed_supernode_restarted_at_once_rejoins(federation, tmp_path, cache_dir):
    """A SuperNode killed outright (no goodbye to the SuperLink) and started again at once: the
    SuperLink refuses its new session until the old one's heartbeats time out, and Flower's
    SuperNode would exit; deploy.supernode starts it again until it is let in, and it trains on
    from the state it had written."""
    import os
    import signal

    from fedvlm.utils.processes import descendants

    out = tmp_path / "runs"
    run = _start_run(
        federation,
        f"method='coop' num-server-rounds=8 min-nodes=1 round-timeout=240 cache-dir='{cache_dir}' "
        f"output-dir='{out}' run-name='crash'",
    )
    results = out / "crash" / "results.json"
    try:
        _wait_rounds(results, 1, run)
        for name in ("org-1-exec", "org-1"):  # the machine loses power: every process at once, no signal handled
            root = federation.procs[name].pid
            for pid in [root, *descendants(root)]:
                os.kill(pid, signal.SIGKILL)
            federation.procs[name].wait(timeout=30)
        federation.start_supernode("org-1")  # and comes back at once
        log, _ = run.communicate(timeout=1500)
    finally:
        if run.poll() is None:
            run.kill()
    data = json.loads(results.read_text())
    assert data["run"]["status"] == "finished", log[-4000:]
    node_log = federation.log_text("org-1")
    assert "did not activate this SuperNode" in node_log, node_log[-6000:]  # it was refused, then let in
    trained = _trained(data, "client-1")
    assert trained[0] == (1, 1) and trained[-1][0] == 8, trained
    # its state came back: it counts on (a round it trained in just before the crash counts too,
    # though its reply was lost with the machine)
    counts = [count for _, count in trained]
    assert counts == sorted(set(counts)) and all(count <= rnd for rnd, count in trained), trained
    # the SuperLink's 'Node Unavailable' for the copy the dead process held does not cost the
    # restarted node's answer (both were dropped as two replies in its name)
    twice = [d for r in data["rounds"] for d in r["dropped"] if "in this node's name" in d["reason"]]
    assert twice == [], twice


HOSTILE = Path(__file__).parent / "hostile_node"


@pytest.mark.slow
def test_hostile_organisations_through_a_real_superlink_are_dropped_and_the_run_goes_on(tmp_path, cache_dir):
    """tests/fuzz.py's corruptions that reach a SuperLink, sent by real SuperNodes whose own
    machines alter their ClientApp (tests/e2e/hostile_node): one corrupts a reply each phase of
    each round (a bad tensor drops the reply, a bad metric only that metric; 2,000 made-up tensor
    names and a 5 MB error reason are recorded in a few hundred characters), one claims no
    training data in its handshake. Duplicate replies and replies in another node's name do not
    reach the ServerApp in deployment: the SuperLink takes one reply per message, from the node
    it was sent to."""
    from fedvlm.deploy.local_federation import LocalFederation

    names = ("org-0", "org-1", "org-2")
    configs = {n: f"partition-id={i} num-partitions=3 name='{n}'" for i, n in enumerate(names)}
    modes = {"org-1": "replies", "org-2": "hello"}
    hostile = {n: {"PYTHONPATH": _hostile_path(), "FEDVLM_HOSTILE": mode} for n, mode in modes.items()}
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "fed", list(names), configs, node_env=hostile, cache_dir=cache_dir) as fed:
        _wait_online(fed, 3)
        run = fed.run_app(
            f"method='promptfl' num-server-rounds=4 min-nodes=2 round-timeout=180 cache-dir='{cache_dir}' "
            f"output-dir='{out}' run-name='hostile'",
            timeout=900,
        )
    assert not pids_matching(str(tmp_path / "fed")), "a Flower process of the federation survived the test"
    text = (out / "hostile" / "results.json").read_text()
    data = json.loads(text, parse_constant=lambda token: pytest.fail(f"results.json holds {token}"))
    assert data["run"]["status"] == "finished", run.stdout[-4000:] + run.stderr[-2000:]
    excluded = data["run"]["excluded_nodes"]
    assert list(excluded.values()) == ["its handshake reports num-train = 0; expected an integer of at least 1"]
    assert sorted(n["name"] for n in data["run"]["nodes"]) == ["org-0", "org-1"]
    assert len(text) < 1_000_000, f"results.json grew to {len(text):,} characters"
    dropped_for = {
        (1, "train"): "its bytes are not a NumPy array",
        (2, "train"): r"wrong tensors: unexpected made-up-0000-x+\.\.\. \(213 characters\), .* and 1,992 more",
        (3, "train"): "not the float32 .* its header says",
    }
    dropped_for[(4, "evaluate")] = r"the client failed: RuntimeError: a 5 MB reason .*\.\.\. \(5,320,013 characters\)"
    refused_for = {
        (1, "evaluate"): r"'local-acc' is 1000000.0, expected in \[0, 1\]",
        (2, "evaluate"): "'smuggled-bits' is not one this project's clients report",
        (3, "evaluate"): r"'local-acc' is -0.5, expected in \[0, 1\]",
    }
    for r in data["rounds"]:
        dropped = {(r["round"], d["phase"]): d["reason"] for d in r["dropped"] if d["client"] == "org-1"}
        refused = {(r["round"], d["phase"]): d["reason"] for d in r["refused_metrics"] if d["client"] == "org-1"}
        assert sorted(dropped) == sorted(k for k in dropped_for if k[0] == r["round"]), r["dropped"]
        assert sorted(refused) == sorted(k for k in refused_for if k[0] == r["round"]), r["refused_metrics"]
        for key, reason in [*dropped.items(), *refused.items()]:
            assert re.search({**dropped_for, **refused_for}[key], reason) and len(reason) < 700, (key, reason[:800])
        assert "org-0" in r["clients"] and not any(d["client"] == "org-0" for d in r["dropped"])
        assert all(0.0 <= v <= 1.0 for k, v in r["metrics"].items() if k.endswith("acc")), r["metrics"]
    ok = subprocess.run([sys.executable, "-m", "fedvlm.status", str(out / "hostile")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout


def _hostile_path() -> str:
    """The hostile node's PYTHONPATH: the folder whose sitecustomize makes it hostile, before the
    test's own path (a checkout run with PYTHONPATH set keeps its fedvlm on every node alike)."""
    return os.pathsep.join(p for p in (str(HOSTILE), os.environ.get("PYTHONPATH", "")) if p)


def test_secure_aggregation_survives_a_node_dropping_out_at_each_stage(tmp_path, cache_dir):
    """A deployed federation of three real SuperNodes with secure aggregation, each pinning the
    federation's roster with its own identity key: the third drops out of each round at one
    stage (keys, shares with the masked vector, the prekeyed train reply that would carry them,
    consistency, unmasking; tests/e2e/hostile_node). Every round still releases the survivors'
    sum, and the node lost after sending its masked vector is still in it."""
    from fedvlm.deploy.local_federation import LocalFederation

    names = ("org-0", "org-1", "org-2")
    configs = {n: f"partition-id={i} num-partitions=3 name='{n}'" for i, n in enumerate(names)}
    hostile = {"org-2": {"PYTHONPATH": _hostile_path(), "FEDVLM_HOSTILE": "secure-dropout"}}
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "fed", list(names), configs, node_env=hostile, cache_dir=cache_dir) as fed:
        _wait_online(fed, 3)
        run = fed.run_app(
            f"method='promptfl' num-server-rounds=5 min-nodes=3 round-timeout=180 cache-dir='{cache_dir}' "
            f"output-dir='{out}' run-name='secure' secure-aggregation.enabled=true replies.max-norm=100.0",
            timeout=900,
        )
    assert not pids_matching(str(tmp_path / "fed")), "a Flower process of the federation survived the test"
    data = json.loads((out / "secure" / "results.json").read_text())
    assert data["run"]["status"] == "finished", run.stdout[-4000:] + run.stderr[-2000:]
    in_sum = [r["secure_aggregation"]["masked"] for r in data["rounds"]]
    assert in_sum == [2, 2, 2, 3, 3], [r["secure_aggregation"] for r in data["rounds"]]
    assert [r["secure_aggregation"]["signed"] for r in data["rounds"]] == [2, 2, 2, 2, 3]
    assert all(len(r["secure_aggregation"]["roster"]) == 16 for r in data["rounds"])  # the federation's roster
    assert not any("failed" in r["secure_aggregation"] for r in data["rounds"])
    assert all(r["bytes"]["train_up"] == 0 and r["bytes"]["secure_up"] > 0 for r in data["rounds"])
