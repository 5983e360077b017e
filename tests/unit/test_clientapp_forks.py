"""The ClientApp fork server: a forked child runs Flower's ClientApp command with the arguments
the SuperExec gave, only that command is forked, and a Flower it does not know, or a server that
is gone, means processes started as Flower starts them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedvlm.deploy import clientapp_forks as forks
from fedvlm.deploy.pinned_app import CLIENTAPP_ENTRY


def _server() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fedvlm.deploy.clientapp_forks", CLIENTAPP_ENTRY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_installed_flower_is_the_executor_the_fork_server_knows():
    import flwr.supercore.superexec.executor.subprocess_executor as executor

    assert forks.check_flower(executor) is None


def test_a_forked_child_runs_the_clientapp_command_with_the_given_arguments():
    server = _server()
    assert server.stdin is not None
    server.stdin.write(json.dumps({"argv": ["fedvlm-clientapp", "--help"], "quiet": False}) + "\n")
    server.stdin.write(json.dumps({"argv": ["fedvlm-clientapp", "--help"], "quiet": True}) + "\n")  # Flower: DEVNULL
    server.stdin.close()  # the SuperExec is gone: the server ends
    assert server.stdout is not None
    out = server.stdout.read()
    assert server.wait(timeout=60) == 0, out
    # Flower's own ClientApp command line, once: the quiet child printed nothing
    assert out.count("usage: fedvlm-clientapp") == 1, out


def test_the_server_refuses_to_fork_with_threads(monkeypatch):
    monkeypatch.setattr(forks, "thread_count", lambda: 3)
    forked = []
    monkeypatch.setattr(forks.os, "fork", lambda: forked.append(1) or 1)
    assert forks.serve(CLIENTAPP_ENTRY, ['{"argv": []}\n']) == 3
    assert not forked


class _Dead:
    stdin = None

    @staticmethod
    def poll():
        return 1


def test_only_the_clientapp_command_is_forked(monkeypatch):
    server = _server()
    started = []
    monkeypatch.setattr(forks.subprocess, "Popen", lambda args, *a, **k: started.append(list(args)) or "proc")
    try:
        stand_in = forks.ForkingPopen("/venv/bin/fedvlm-clientapp", server)
        assert stand_in.Popen(["/venv/bin/fedvlm-clientapp", "--token", "t"]) is None  # to the fork server
        assert stand_in.Popen(["/venv/bin/flwr-serverapp", "--x"]) == "proc"  # any other command: a process
        assert stand_in.DEVNULL is subprocess.DEVNULL
        assert started == [["/venv/bin/flwr-serverapp", "--x"]]
        # the fork server gone: the ClientApp starts as a process, as Flower would start it
        gone = forks.ForkingPopen("/venv/bin/fedvlm-clientapp", _Dead())  # type: ignore[arg-type]
        assert gone.Popen(["/venv/bin/fedvlm-clientapp", "--token", "t"]) == "proc"
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=60)


@pytest.mark.parametrize(
    "launch",
    [
        "def launch(self, spec):\n    proc = subprocess.Popen(['x'])\n    return proc\n",
        "def launch(self, spec):\n    os.execv('x', ['x'])\n",
    ],
)
def test_an_executor_that_changed_is_left_alone(launch, monkeypatch):
    import flwr.supercore.superexec.executor.subprocess_executor as executor

    monkeypatch.setattr(forks.inspect, "getsource", lambda obj: launch)
    assert forks.check_flower(executor) is not None
    monkeypatch.setattr(executor, "subprocess", subprocess)
    assert forks.install("/venv/bin/fedvlm-clientapp", CLIENTAPP_ENTRY) is None
    assert executor.subprocess is subprocess


def test_the_entry_is_the_clientapp_script():
    from pathlib import Path

    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedvlm-clientapp"] == CLIENTAPP_ENTRY  # the fork server runs what the script runs


def test_a_forked_child_dies_with_its_fork_server():
    import os
    import signal
    from pathlib import Path

    # a target that never returns, so the child is still running when the server is killed
    server = subprocess.Popen(
        [sys.executable, "-m", "fedvlm.deploy.clientapp_forks", "signal:pause"], stdin=subprocess.PIPE, text=True
    )
    assert server.stdin is not None
    server.stdin.write(json.dumps({"argv": ["pause"]}) + "\n")
    server.stdin.flush()
    children: list[int] = []
    for _ in range(300):
        children = [int(p) for p in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
        if children:
            break
        time.sleep(0.1)
    assert len(children) == 1
    os.kill(server.pid, signal.SIGKILL)  # the node is torn down
    server.wait(timeout=30)
    for _ in range(100):
        if not Path(f"/proc/{children[0]}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{children[0]}").exists(), "a forked ClientApp outlived its fork server"


def test_the_fork_server_holds_the_clientapp_module_its_children_load():
    """Flower's ``load_app`` imports the ClientApp's module in every child unless it is in
    ``sys.modules`` already: 0.4 s of a 0.6 s secure stage on a node before the server imported it.
    The server imports it (and stays single-threaded: it serves), so every child starts with it;
    it also answers the pin's check of Flower and the source digest once, for every child
    (``pinned_app.prepare``: a third of a child's CPU before)."""
    from pathlib import Path

    import tomllib

    from fedvlm.deploy.pinned_app import WARM

    flwr_app = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["tool"]["flwr"]
    assert flwr_app["app"]["components"]["clientapp"].partition(":")[0] in WARM
    code = (
        "import sys; from fedvlm.deploy import clientapp_forks as f; "
        f"assert f.serve({CLIENTAPP_ENTRY!r}, []) == 0; "
        f"print('warm:', [m for m in {WARM!r} if m in sys.modules]); "
        "from fedvlm.deploy.pinned_app import check_flower; from fedvlm.client_app import worker; "
        "print('prepared:', check_flower.cache_info().currsize, len(worker._DIGEST))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [f"warm: {list(WARM)!r}", "prepared: 1 1"]


def test_the_server_reaps_its_children_so_their_cpu_is_counted():
    """A finished child leaves no zombie, and its CPU time is added to the server's children's
    (the per-program profile reads it there; ignored SIGCHLD left it counted nowhere)."""
    import os

    server = subprocess.Popen(
        [sys.executable, "-m", "fedvlm.deploy.clientapp_forks", "timeit:main"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps({"argv": ["timeit", "-n", "5000000", "x = 1"], "quiet": False}) + "\n")
    server.stdin.flush()
    assert "loops" in server.stdout.readline()  # the child ran and printed its timing
    deadline = time.time() + 30
    while time.time() < deadline:
        stat = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == server.pid]
        if not children and int(stat[13]) + int(stat[14]) > 0:
            break
        time.sleep(0.1)
    assert not children, "a finished child is still there (a zombie)"
    assert int(stat[13]) + int(stat[14]) > 0, "the child's CPU is not among the server's children's"
    server.stdin.close()
    assert server.wait(timeout=60) == 0


def _parent(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None
