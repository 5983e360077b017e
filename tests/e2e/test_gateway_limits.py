"""The Fleet gateway as a real process on loopback, under clients that abuse it: a TLS handshake
or a request that never finishes is cut off in seconds, one address cannot hold more than its
share of connections, oversized headers are refused, every refusal is logged with the real peer,
and the log rotates; meanwhile an honest request is still answered. bench/gateway_abuse.py
measures what an honest SuperNode sees under heavier abuse."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from fedvlm.deploy.credentials import generate
from fedvlm.utils.processes import free_port, kill_tree

pytestmark = pytest.mark.ci  # seconds, not minutes: kept in CI


def _start_gateway(work, *limits: str):
    """A gateway process with ``limits`` (its flags): (port, client TLS context, log, process)."""
    generate(work / "creds", [], [], [])
    port = free_port()
    log = work / "gateway.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedvlm.deploy.fleet_gateway",
            "--listen",
            f"127.0.0.1:{port}",
            "--superlink",
            f"127.0.0.1:{free_port()}",  # nothing listens: an honest call is answered 502
            "--certfile",
            str(work / "creds" / "server.crt"),
            "--keyfile",
            str(work / "creds" / "server.key"),
            "--ca",
            str(work / "creds" / "ca.crt"),
            "--log-file",
            str(log),
            *limits,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    context = ssl.create_default_context(cafile=str(work / "creds" / "ca.crt"))
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"the gateway did not start: {log.read_text() if log.exists() else ''}") from None
            time.sleep(0.2)
    return port, context, log, proc


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    port, context, log, proc = _start_gateway(
        tmp_path_factory.mktemp("gateway"),
        "--handshake-timeout=1",
        "--header-timeout=1",
        "--body-timeout=2",
        "--max-per-peer=4",
        "--max-header=4096",
        "--log-max-mb=0.001",  # about 1 KB: rotated within the test
        "--log-backups=2",
    )
    yield port, context, log
    kill_tree(proc.pid)


def _tls(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    return context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="localhost")


def _closed_within(sock, seconds: float) -> float:
    """How long until the server closed ``sock`` (AssertionError after ``seconds``)."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(1024):
            pass
    except TimeoutError:
        raise AssertionError(f"still open after {seconds} s") from None
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    return time.monotonic() - t0


def _signed(key=None) -> bytes:
    """A SuperNode's authentication headers, as Flower's interceptor writes them (a new key by default)."""
    from base64 import b64encode

    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.supercore.date import now
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

    key = key or ec.generate_private_key(ec.SECP384R1())
    stamp = now().isoformat()
    public = b64encode(public_key_to_bytes(key.public_key())).decode()
    signature = b64encode(sign_message(key, stamp.encode("ascii"))).decode()
    return f"flwr-public-key: {public}\r\nflwr-timestamp: {stamp}\r\nflwr-signature: {signature}\r\n".encode()


def _honest(port: int, context: ssl.SSLContext, key=None) -> int:
    """An honest Fleet call's status (502: the gateway answered; its SuperLink is not there)."""
    with _tls(port, context) as s:
        head = b"POST /v1/fleet/send-node-heartbeat HTTP/1.1\r\nHost: x\r\n" + _signed(key)
        s.sendall(head + b"Content-Length: 2\r\n\r\nhi")
        return int(s.recv(4096).split(b" ", 2)[1])


def _logged(log, text: str, seconds: float = 5.0) -> str:
    deadline = time.time() + seconds
    while time.time() < deadline:
        logs = "".join(p.read_text() for p in sorted(log.parent.glob(log.name + "*")))
        if text in logs:
            return logs
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the gateway's log:\n{logs[-3000:]}")


def test_slow_clients_are_cut_off_and_an_honest_one_is_answered(gateway):
    port, context, log = gateway
    silent = socket.create_connection(("127.0.0.1", port), timeout=10)  # never starts TLS
    dripping = _tls(port, context)
    dripping.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
        for _ in range(40):  # a header byte every 0.1 s: 4 s if nothing cut it off
            dripping.sendall(b"X")
            time.sleep(0.1)
    assert time.monotonic() - t0 < 3.0
    assert _closed_within(silent, 4.0) < 4.0
    assert _honest(port, context) == 502
    _logged(log, "closed a connection from 127.0.0.1: the request's headers took longer than allowed")


def test_one_address_holds_at_most_its_share_and_headers_are_bounded(gateway):
    port, context, log = gateway
    held = [_tls(port, context) for _ in range(4)]
    t0 = time.monotonic()
    with pytest.raises((ConnectionError, ssl.SSLError, OSError)):  # closed before its TLS handshake
        _tls(port, context)
    assert time.monotonic() - t0 < 0.9
    _logged(log, "refused connections from 127.0.0.1: 4 open from it")
    for s in held:
        s.close()
    time.sleep(0.2)
    with _tls(port, context) as s:
        s.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
        assert int(s.recv(4096).split(b" ", 2)[1]) == 431
    _logged(log, "refused pull-messages from 127.0.0.1: 8018 bytes of headers, over 4096")
    with _tls(port, context) as s:  # still arriving past the cap: h11's own answer was 400, unlogged
        s.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000)
        assert int(s.recv(4096).split(b" ", 2)[1]) == 431
    _logged(log, "refused a request from 127.0.0.1: its headers ran past 4096 bytes")
    assert _honest(port, context) == 502
    for _ in range(8):  # refused, each with a log line naming the real peer
        with _tls(port, context) as s:
            s.sendall(b"POST /v1/control/start-run HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.66\r\n\r\n")
            assert int(s.recv(4096).split(b" ", 2)[1]) == 403
    logs = _logged(log, "refused POST /v1/control/start-run from 127.0.0.1")
    assert "203.0.113.66" not in logs
    assert (log.parent / (log.name + ".1")).exists() and not (log.parent / (log.name + ".3")).exists()  # rotated


def test_connections_that_arrive_together_are_all_answered(gateway):
    """Each connection's TLS starts after its address is counted; a request that arrives as soon as
    its handshake ends (before the gateway took the connection over) is answered all the same: a
    SuperNode's pooled connection and another that connects anew for every call, at once."""
    import httpx

    port, context, _ = gateway
    answered: dict[bool, list] = {True: [], False: []}

    def calls(fresh: bool) -> None:
        client = None
        for _ in range(10):
            if client is None or fresh:
                transport = httpx.HTTPTransport(verify=context, local_address="127.0.0.5" if fresh else "127.0.0.6")
                client = httpx.Client(base_url=f"https://127.0.0.1:{port}", transport=transport, timeout=5)
            try:
                head = dict(line.split(": ", 1) for line in _signed().decode().strip().split("\r\n"))
                answered[fresh].append(
                    client.post("/v1/fleet/send-node-heartbeat", content=b"x", headers=head).status_code
                )
            except httpx.HTTPError as err:
                answered[fresh].append(type(err).__name__)
            if fresh:
                client.close()
            time.sleep(0.05)
        client.close()

    threads = [threading.Thread(target=calls, args=(fresh,)) for fresh in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert answered == {False: [502] * 10, True: [502] * 10}


def test_silent_connections_cannot_hold_the_slots_an_honest_client_needs(tmp_path):
    """Plain TCP connections that never send a TLS byte, from 20 addresses, kept the gateway's
    1024 slots full (a fresh client got 3 answers out of 17 in 40 s). Pending handshakes are held
    apart now: a few per address, and a pool whose oldest gives way to a new connection."""
    port, context, log, proc = _start_gateway(
        tmp_path, "--handshake-timeout=30", "--max-handshakes=3", "--max-handshakes-per-peer=16"
    )
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        time.sleep(0.3)
        assert _honest(port, context) == 502  # answered: the oldest silent connection gave way
        assert _closed_within(silent[0], 2.0) < 2.0
        _logged(log, "closed the oldest pending TLS handshake (from 127.0.0.1): 3 pending in all")
    finally:
        kill_tree(proc.pid)
    port, context, log, proc = _start_gateway(
        tmp_path / "per-peer", "--handshake-timeout=30", "--max-handshakes-per-peer=2"
    )
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        assert _closed_within(silent[2], 2.0) < 2.0  # the third from one address: refused at once
        _logged(log, "refused a connection from 127.0.0.1: 2 TLS handshakes pending from it")
    finally:
        kill_tree(proc.pid)


def test_a_body_without_a_registered_nodes_signature_is_refused_before_it_is_read(tmp_path):
    """Unauthenticated bodies just under the cap were buffered whole and parsed by the SuperLink
    before it authenticated them; the gateway now checks the SuperNode authentication first."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    registered = ec.generate_private_key(ec.SECP384R1())
    pub = registered.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (tmp_path / "org-0.pub").write_bytes(pub)
    port, context, log, proc = _start_gateway(tmp_path, f"--node-keys={tmp_path / 'org-0.pub'}")
    try:
        with _tls(port, context) as s:  # 6 MB announced, none sent: answered at once, from the headers
            s.sendall(b"POST /v1/fleet/push-object HTTP/1.1\r\nHost: x\r\nContent-Length: 6000000\r\n\r\n")
            assert int(s.recv(4096).split(b" ", 2)[1]) == 401
        _logged(log, "refused push-object from 127.0.0.1 before its body: it carries no SuperNode authentication")
        assert _honest(port, context) == 412  # signed, by a key nobody registered: Flower's failed activation
        _logged(log, "its key is not one of the registered SuperNodes'")
        assert _honest(port, context, registered) == 502  # a registered node: forwarded
    finally:
        kill_tree(proc.pid)
