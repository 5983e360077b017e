"""Twenty SuperNodes on one SuperLink, on loopback (deploy.local_federation with TLS and
SuperNode authentication): every node joins, trains and evaluates in every round, and the
report holds the federation's peak memory per program and each round's time.

About 10 minutes on two cores: no node has a warm worker here, so each message starts a ClientApp
that imports torch and loads CLIP. The scale figures of docs/results/deployment.md come from the
same command with ``--workers`` and three rounds."""

from __future__ import annotations

import json
import subprocess
import sys

from fedvlm.utils.processes import pids_matching

NODES = 20


def test_twenty_supernodes_join_one_superlink_and_train_every_round(tmp_path, cache_dir, pretrained_clip):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedvlm.deploy.local_federation",
            "--workdir",
            str(tmp_path / "fed"),
            "--supernodes",
            str(NODES),
            "--report",
            str(report),
            "--cache-dir",
            str(cache_dir),
            "--run-config",
            f"method='promptfl' num-server-rounds=2 min-nodes={NODES} round-timeout=480 cache-dir='{cache_dir}' "
            f"output-dir='{tmp_path / 'runs'}'",
        ],
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["status"] == "finished", proc.stdout[-4000:]
    # every node answered every message, or its SuperNode logged the reply as lost on the way:
    # under twenty nodes Flower's SQLite state answers a few requests with 'database is locked'
    # (HTTP 500) and the SuperNode does not push again; the server asks again after a grace
    # (server_app/exchange.py), and a reply lost twice leaves the round to the others
    missing = sum(2 * NODES - r["train-clients"] - r["evaluate-clients"] for r in data["rounds"])
    assert len(data["rounds"]) == 2 and missing <= data["replies_lost_in_transit"] < NODES // 2, data
    programs = data["peak_by_program"]
    # each SuperNode is Flower's, run by the polling shim under its restarting supervisor
    assert programs["fedvlm.deploy.supernode_polling"]["processes"] == NODES, programs
    assert programs["fedvlm.deploy.supernode"]["processes"] == NODES, programs
    assert programs["flower-superlink"]["processes"] == 1 and programs["flwr-serverapp"]["processes"] == 1
    assert 0 < data["peak_pss_mib"] <= data["peak_rss_mib"]
    results = json.loads(next((tmp_path / "runs").glob("*/results.json")).read_text())
    assert len(results["run"]["nodes"]) == NODES and results["run"]["excluded_nodes"] == {}
    assert not pids_matching(str(tmp_path / "fed")), "a Flower process of the federation survived"
