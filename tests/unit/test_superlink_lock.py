"""The SuperLink host's lock (deploy.superlink): the account that owns a calling socket is read
from the kernel's table while the connection is open, so that the SuperLink serves only the
accounts its operator names; and the SuperExec it starts carries the secret."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fedvlm.deploy.superlink import OWNED_BY_US, check_flower, main, socket_owner, superexec_command
from fedvlm.utils.processes import free_port, kill_tree


def _connect_as(uid: int | None, port: int) -> tuple[int, int, int]:
    """A child process (as ``uid``, when root can switch) connects to ``port`` and waits; returns
    (its pid, the write end that ends it, its socket's port)."""
    ready, done = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(ready[0])
            os.close(done[1])
            if uid is not None:
                os.setuid(uid)
            s = socket.socket()
            s.connect(("127.0.0.1", port))
            os.write(ready[1], str(s.getsockname()[1]).encode())
            os.read(done[0], 1)
        except BaseException as err:
            os.write(ready[1], f"error {err!r}".encode())
        finally:
            os._exit(0)
    os.close(ready[1])
    os.close(done[0])
    said = os.read(ready[0], 200).decode()
    os.close(ready[0])
    assert said.isdigit(), said
    return pid, done[1], int(said)


@pytest.mark.parametrize("ipv6", [False, True])
def test_the_owner_of_a_calling_socket_is_the_account_that_opened_it(ipv6):
    family, host = (socket.AF_INET6, "::ffff:127.0.0.1") if ipv6 else (socket.AF_INET, "127.0.0.1")
    server = socket.socket(family)
    server.bind((host, 0) if not ipv6 else ("::", 0))
    server.listen()
    port = server.getsockname()[1]
    uids = [None] + ([65534] if os.getuid() == 0 else [])  # another account where the test may switch
    try:
        for uid in uids:
            pid, done, client_port = _connect_as(uid, port)
            conn, _ = server.accept()
            try:
                owner = socket_owner(("127.0.0.1", client_port), ("127.0.0.1", port))
                assert owner == (os.getuid() if uid is None else uid)
            finally:
                os.write(done, b"x")
                os.waitpid(pid, 0)
                conn.close()
        time.sleep(0.1)
        # a socket that is no longer open, or was never on this machine, belongs to nobody here
        assert socket_owner(("127.0.0.1", client_port), ("127.0.0.1", port)) is None
        assert socket_owner(("203.0.113.7", 40000), ("127.0.0.1", port)) is None
    finally:
        server.close()


def test_the_superexec_carries_the_secret_and_the_flags_are_ours(tmp_path, capsys):
    args = ["--host", "127.0.0.1", "--port", "9093", "--ssl-ca-certfile", "/c/ca.crt"]
    command = superexec_command(args, tmp_path / "secret")
    assert command[-2:] == ["--superexec-auth-secret-file", str(tmp_path / "secret")]
    assert ["--root-certificates", "/c/ca.crt"] == command[3:5] and "127.0.0.1:9093" in command
    assert command[:3] == [sys.executable, "-m", "fedvlm.deploy.task_reaping"]  # flower-superexec, reaping
    for flag in OWNED_BY_US:  # a SuperLink started without its own SuperExec's secret is refused
        with pytest.raises(SystemExit):
            main(["--", *args, flag, "x"])
        assert "set by this command" in capsys.readouterr().err


def test_the_installed_flower_is_the_one_the_lock_wraps():
    import importlib

    assert check_flower(importlib.import_module("flwr.superlink.cli.flower_superlink")) is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_superlink_leaves_no_secret_behind(sig, tmp_path):
    """uvicorn raises the stopping signal again once the server is down: the process must still
    unwind and remove the SuperExec secret it made for this start (26 were left in /tmp before)."""
    port = free_port()
    log = tmp_path / "superlink.log"
    temp = tmp_path / "tmp"
    temp.mkdir()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fedvlm.deploy.superlink",
                "--",
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(temp)},
        )
    try:
        deadline = time.time() + 60
        while "Uvicorn running" not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert [p.name for p in temp.iterdir()][0].startswith("fedvlm-superexec-"), log.read_text()[-2000:]
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
        assert list(temp.iterdir()) == [], "the SuperExec secret outlived its SuperLink"
    finally:
        kill_tree(proc.pid)
