"""Stopping a run: `python -m fedvlm.stop` ends the local SuperLink that `flwr run .` left behind,
the simulation it was still running after `flwr run` itself was interrupted, and the whole Ray
cluster that simulation started; nothing survives, and the run folder says it was interrupted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from fedvlm.stop import _alive, everything_started_by, local_superlinks
from fedvlm.utils.processes import FLWR, ROOT, cmdline, flwr_env, kill_tree


def test_stop_ends_the_run_and_everything_it_started(tmp_path, cache_dir, pretrained_clip):
    home = tmp_path / "flwr-home"
    env = flwr_env(home)
    out = tmp_path / "runs"
    cli = subprocess.Popen(
        [
            FLWR,
            "run",
            str(ROOT),
            "--stream",
            "--federation-config",
            "num-supernodes=3",
            "--run-config",
            f"num-server-rounds=200 cache-dir='{cache_dir}' output-dir='{out}' run-name='long'",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results = out / "long" / "results.json"
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not (results.exists() and json.loads(results.read_text()).get("rounds")):
            time.sleep(1)
        assert results.exists(), "the run did not start"
        cli.send_signal(signal.SIGINT)  # the user's Ctrl-C: the CLI goes, the run does not
        cli.wait(timeout=60)
        time.sleep(3)
        roots = local_superlinks(home)
        started = everything_started_by(roots)
        programs = " ".join(cmdline(p) for p in started)
        assert roots and "flwr-simulation" in programs and "raylet" in programs, programs[:2000]

        stop = subprocess.run(
            [sys.executable, "-m", "fedvlm.stop", "--flwr-home", str(home)], capture_output=True, text=True, timeout=120
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        survivors = [p for p in started if _alive(p)]
        assert not survivors, [cmdline(p) for p in survivors]
        assert not local_superlinks(home)
    finally:
        for root in local_superlinks(home):  # never leave a federation behind, also on failure
            kill_tree(root)
        if cli.poll() is None:
            cli.kill()
    assert f"{out / 'long'}: interrupted after round" in stop.stdout, stop.stdout
    data = json.loads(results.read_text())
    assert data["run"]["status"] == "interrupted" and f"resume='{out / 'long'}'" in data["run"]["note"], data["run"]
    status = subprocess.run([sys.executable, "-m", "fedvlm.status", str(out / "long")], capture_output=True, text=True)
    assert status.returncode == 5 and "interrupted after" in status.stdout, status.stdout  # it never finished
    again = subprocess.run(
        [sys.executable, "-m", "fedvlm.stop", "--flwr-home", str(home)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and "nothing to stop" in again.stdout
