"""Benchmark: what an honest SuperNode sees while other clients abuse the Fleet gateway.

Runs the gateway as its own process on loopback in front of a stand-in SuperLink (an HTTPS
server that answers every Fleet call at once, so that what is measured is the gateway), and an
honest client, as a SuperNode calls (one pooled TLS connection, a small Fleet call every
``--interval`` seconds, from 127.0.0.2; and one that opens a new connection for every call, from
127.0.0.4, as a node that joins or comes back does), while an attacker on 127.0.0.3 does one of:

- ``slowloris``: ``--connections`` TLS connections that send a request's headers a byte every 5 s;
- ``slow-tls``: ``--connections`` TCP connections that never start their TLS handshake;
- ``idle``: ``--connections`` TLS connections that never send a request;
- ``big-body``: ``--big`` clients each sending a ``--big-mib`` MiB body as fast as loopback goes;
- ``big-headers``: clients sending 1 MiB of headers, one after another.

Each attack runs against the gateway as it is (``fedvlm``) and as it was before its limits
(``unguarded``: uvicorn's defaults, as in the gateway of main before issue 43), side by side in
this one run. Per case: the honest calls that succeeded, their median and 95th-percentile time,
the files (its listening socket, logs and the connections it holds) the gateway has open at the
end, and its peak memory. Everything
stays on loopback and is bounded (``--connections``, ``--seconds``).

    python bench/gateway_abuse.py --seconds 20 --connections 1500 --json docs/results/gateway_abuse.json

The gateway processes start with a soft limit of ``--nofile`` open files (1024, Linux's usual
default): the gateway of issue 43 raises its own to the hard limit, the one before did not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.measure import bench_report
from fedvlm.deploy.credentials import generate
from fedvlm.utils.processes import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[1]

HONEST, HONEST_FRESH, ATTACKER = "127.0.0.2", "127.0.0.4", "127.0.0.3"
UPSTREAM = """
import sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
async def ok(request):
    await request.body()
    return Response(b"ok")
app = Starlette(routes=[Route("/{p:path}", ok, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), ssl_certfile=sys.argv[2], ssl_keyfile=sys.argv[3],
            log_level="error")
"""
# the gateway before its limits: the same app, served with uvicorn's defaults
UNGUARDED = """
import sys, uvicorn
from fedvlm.deploy.fleet_gateway import Limits, make_app
app = make_app(sys.argv[2], sys.argv[5], Limits(max_body=1 << 40, max_header=1 << 40))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), ssl_certfile=sys.argv[3], ssl_keyfile=sys.argv[4],
            log_level="error")
"""


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Gateway:
    def __init__(self, mode: str, creds: Path, upstream: int, log: Path, nofile: int):
        self.port = free_port()
        args = [f"127.0.0.1:{upstream}", str(creds / "server.crt"), str(creds / "server.key"), str(creds / "ca.crt")]
        if mode == "fedvlm":
            command = [
                sys.executable,
                "-m",
                "fedvlm.deploy.fleet_gateway",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--superlink",
                args[0],
                "--certfile",
                args[1],
                "--keyfile",
                args[2],
                "--ca",
                args[3],
                "--log-file",
                str(log),
            ]
        else:
            command = [sys.executable, "-c", UNGUARDED, str(self.port), *args]
        soft = nofile

        def limit() -> None:  # as the gateway would start under a usual login
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))

        self.proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, preexec_fn=limit
        )
        _wait(self.port)
        self.peak = 0.0

    def sample(self) -> None:
        self.peak = max(self.peak, _rss_mib(self.proc.pid))

    def stop(self) -> None:
        kill_tree(self.proc.pid)


def _wait(port: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port}")


def honest(port: int, ca: Path, stop: threading.Event, interval: float, out: list, fresh: bool) -> None:
    """A SuperNode's calls: one pooled connection (httpx, as Flower's Fleet client), or a new
    connection for every call (``fresh``: a node that joins, or comes back after an idle spell)."""
    from base64 import b64encode

    import httpx
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.supercore.date import now
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

    key = ec.generate_private_key(ec.SECP384R1())  # its SuperNode key: the gateway checks the signature first
    public = b64encode(public_key_to_bytes(key.public_key())).decode()
    context = ssl.create_default_context(cafile=str(ca))
    address = HONEST_FRESH if fresh else HONEST
    client = None
    while not stop.is_set():
        stamp = now().isoformat()
        signature = b64encode(sign_message(key, stamp.encode("ascii"))).decode()
        head = {"flwr-public-key": public, "flwr-timestamp": stamp, "flwr-signature": signature}
        if client is None or fresh:
            transport = httpx.HTTPTransport(local_address=address, verify=context)
            client = httpx.Client(base_url=f"https://127.0.0.1:{port}", transport=transport, timeout=10)
        t0 = time.monotonic()
        try:
            ok = client.post("/v1/fleet/send-node-heartbeat", content=b"\x08\x01", headers=head).status_code == 200
        except httpx.HTTPError:
            ok = False
        out.append((ok, time.monotonic() - t0))
        if fresh:
            client.close()
        stop.wait(interval)
    if client is not None:
        client.close()


def _tcp(port: int) -> socket.socket:
    s = socket.socket()
    s.bind((ATTACKER, 0))
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    return s


def attack(kind: str, port: int, ca: Path, stop: threading.Event, args, held: list) -> None:
    """Runs ``kind`` until ``stop``, keeping its open sockets in ``held``."""
    context = ssl.create_default_context(cafile=str(ca))
    if kind in ("slowloris", "idle", "slow-tls"):
        for _ in range(args.connections):
            if stop.is_set():
                break
            try:
                s = _tcp(port)
                if kind != "slow-tls":
                    s = context.wrap_socket(s, server_hostname="localhost")
                    if kind == "slowloris":
                        s.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: x\r\n")
                held.append(s)
            except OSError:
                continue
        while not stop.wait(5):
            for s in list(held):
                try:
                    if kind == "slowloris":
                        s.sendall(b"X")
                except OSError:
                    held.remove(s)
        return

    def big_body() -> None:
        chunk = b"\x00" * (1 << 20)
        while not stop.is_set():
            try:
                s = context.wrap_socket(_tcp(port), server_hostname="localhost")
                head = f"POST /v1/fleet/push-object HTTP/1.1\r\nHost: x\r\nContent-Length: {args.big_mib << 20}\r\n\r\n"
                s.sendall(head.encode())
                for _ in range(args.big_mib):
                    s.sendall(chunk)
                s.recv(100)
                s.close()
            except OSError:
                time.sleep(0.05)

    def big_headers() -> None:
        while not stop.is_set():
            try:
                s = context.wrap_socket(_tcp(port), server_hostname="localhost")
                s.sendall(
                    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n"
                )
                s.recv(100)
                s.close()
            except OSError:
                time.sleep(0.05)

    target = big_body if kind == "big-body" else big_headers
    threads = [threading.Thread(target=target, daemon=True) for _ in range(args.big if kind == "big-body" else 2)]
    for t in threads:
        t.start()
    stop.wait()


def case(mode: str, kind: str, creds: Path, upstream: int, work: Path, args) -> dict:
    gateway = Gateway(mode, creds, upstream, work / f"{mode}-{kind}.log", args.nofile)
    stop, calls, fresh = threading.Event(), [], []
    held: list = []
    threads = [
        threading.Thread(target=honest, args=(gateway.port, creds / "ca.crt", stop, args.interval, out, new))
        for out, new in ((calls, False), (fresh, True))
    ]
    if kind != "none":
        threads.append(threading.Thread(target=attack, args=(kind, gateway.port, creds / "ca.crt", stop, args, held)))
    for t in threads:
        t.start()
    t_end = time.time() + args.seconds
    while time.time() < t_end:
        gateway.sample()
        time.sleep(0.25)
    files = len(os.listdir(f"/proc/{gateway.proc.pid}/fd"))
    stop.set()
    for t in threads:
        t.join(timeout=30)
    for s in held:
        s.close()
    gateway.stop()
    times = sorted(dt for ok, dt in calls if ok)
    row = {
        "gateway": mode,
        "attack": kind,
        "honest_calls": len(calls),
        "honest_ok": sum(ok for ok, _ in calls),
        "honest_median_ms": round(1000 * statistics.median(times), 1) if times else None,
        "honest_p95_ms": round(1000 * times[int(0.95 * (len(times) - 1))], 1) if times else None,
        "new_connection_calls": len(fresh),
        "new_connection_ok": sum(ok for ok, _ in fresh),
        "gateway_open_files_at_end": files,
        "gateway_peak_rss_mib": round(gateway.peak),
    }
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="length of each case")
    p.add_argument("--connections", type=int, default=1000, help="connections a slow attacker opens")
    p.add_argument("--big", type=int, default=4, help="clients sending big bodies")
    p.add_argument("--big-mib", type=int, default=200, help="MiB in each big body")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between the honest client's calls")
    p.add_argument("--attacks", default="none,slowloris,slow-tls,idle,big-body,big-headers")
    p.add_argument("--modes", default="fedvlm,unguarded")
    p.add_argument(
        "--nofile",
        type=int,
        default=1024,
        help="the gateway process's soft limit on open files (Linux's usual default; fedvlm's raises its own)",
    )
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gateway-abuse-"))
    generate(work / "creds", [], [], [])
    upstream = free_port()
    stub = subprocess.Popen(
        [
            sys.executable,
            "-c",
            UPSTREAM,
            str(upstream),
            str(work / "creds" / "server.crt"),
            str(work / "creds" / "server.key"),
        ]
    )
    rows = []
    try:
        _wait(upstream)
        for kind in args.attacks.split(","):
            for mode in args.modes.split(","):
                rows.append(case(mode, kind, work / "creds", upstream, work, args))
    finally:
        kill_tree(stub.pid)
    print(f"\n{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.seconds:.0f} s a case")
    print(
        "| attack | gateway | pooled calls ok | median ms | p95 ms | new-connection calls ok "
        "| gateway open files at end | gateway peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['attack']} | {r['gateway']} | {r['honest_ok']}/{r['honest_calls']} | {r['honest_median_ms']} | "
            f"{r['honest_p95_ms']} | {r['new_connection_ok']}/{r['new_connection_calls']} | "
            f"{r['gateway_open_files_at_end']} | {r['gateway_peak_rss_mib']} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(bench_report({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}), indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
