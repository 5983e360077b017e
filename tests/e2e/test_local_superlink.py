"""The guarded local SuperLink (`python -m fedvlm.deploy.superlink --local`): started as Flower's
CLI starts the one `flwr run .` uses, on the port `flwr run .` probes, it answers this account and
refuses any other before parsing a request; `python -m fedvlm.stop` finds and ends it. (A second
account's `flwr run .` used to land in the first account's local SuperLink and run as it.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from fedvlm.stop import _alive, local_superlinks
from fedvlm.stop import main as stop
from fedvlm.utils.processes import ROOT, flwr_env, free_port, kill_tree

PROBE = (
    "import sys, urllib.error, urllib.request\n"
    "try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)\n"
    "except urllib.error.HTTPError as e:\n    print(e.code)\n"
    "except Exception as e:\n    print(type(e).__name__)\n"
)


@pytest.mark.ci  # quick (a SuperLink alone), and the one guard a shared machine has
def test_the_guarded_local_superlink_serves_only_its_account_and_stops(tmp_path):
    home = tmp_path / "flwr-home"
    env = flwr_env(home)
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    link = subprocess.Popen(
        [sys.executable, "-m", "fedvlm.deploy.superlink", "--local"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    health = f"http://127.0.0.1:{port}/health"
    try:
        deadline, status = time.time() + 120, None
        while time.time() < deadline and status != 200:
            try:
                status = httpx.get(health, timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.5)
        assert status == 200  # `flwr run .` finds it answering, and uses it
        assert link.pid in local_superlinks(home)  # its log is under this FLWR_HOME
        if os.getuid() == 0:  # another account, as a shared machine has them (with a Python it may run)
            python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
            other = subprocess.run([python, "-c", PROBE, health], user=65534, capture_output=True, text=True)
            assert other.stdout.strip() == "403", (other.stdout, other.stderr[-500:])
        with pytest.raises(SystemExit):  # it sets flower-superlink's arguments itself
            from fedvlm.deploy.superlink import main

            main(["--local", "--", "--port", str(free_port())])
        assert stop(["--flwr-home", str(home)]) == 0
        deadline = time.time() + 60
        while time.time() < deadline and _alive(link.pid):
            time.sleep(0.2)
        assert not _alive(link.pid)
    finally:
        kill_tree(link.pid)


@pytest.mark.ci
def test_a_local_superlink_that_does_not_answer_in_time_is_stopped_and_named(tmp_path):
    """flwr_run starts the local SuperLink itself, with a bound it sets (Flower's CLI gives it 15 s,
    which a busy host overran); past the bound it is stopped, and the error says the load."""
    from fedvlm.utils.processes import pids_matching, start_local_superlink

    env = flwr_env(tmp_path / "flwr-home")
    with pytest.raises(TimeoutError, match=r"did not answer .* within 0 s \(load average [0-9.]+ on \d+ CPUs\)"):
        start_local_superlink(env, bound=0.01)
    assert not pids_matching(str(tmp_path / "flwr-home"))
