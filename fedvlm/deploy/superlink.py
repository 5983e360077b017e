"""The SuperLink host's lock: only the researcher's account reaches the SuperLink, and only its
own SuperExec takes the ServerApp's tasks.

Flower 1.42's SuperLink serves the Control API (``flwr run``, ``ls``, ``log``, ``stop``,
``supernode register``), the ServerApp runtime and the Fleet API on one port, authenticates no
Control API user (that is Flower's enterprise edition), and with its default isolation starts a
SuperExec that takes ServerApp tasks with no secret: on the SuperLink host every local account
was the researcher (it could start runs, and take a running ServerApp's task with its token, run
config and FAB), and so was every container on a host network.

    python -m fedvlm.deploy.superlink [--allow-uid UID ...] [--signing-key server-signing.key] \\
        [--task-start-window 300] [--task-starts 3] -- \\
        <flower-superlink's arguments (--host 127.0.0.1 --port ... TLS ... --database ...)>

runs Flower's own SuperLink in this process with two changes:

- **Only the allowed accounts** (``--allow-uid``; default: the account running it, which also
  runs the Fleet gateway and whose ``flwr`` the researcher uses on the host or through an SSH
  tunnel) reach any of its APIs. For every connection, when it is made, the kernel's table of
  this machine's TCP sockets (``/proc/net/tcp``, ``/proc/net/tcp6``) names the account that owns
  the calling socket; a connection of another account, or from a socket not on this machine, is
  answered 403 without its request being parsed, closed and logged. So the SuperLink must listen
  on a loopback address, and SuperNodes reach it only through the gateway.
- **Its own SuperExec, with a secret.** Flower's SuperLink is run with ``--isolation process``
  and ``--superexec-auth-secret-file``, and this process starts ``flower-superexec`` beside it
  (``deploy.task_reaping``: a finished ServerApp is reaped at once, not left a zombie)
  with the same secret (made anew at every start, 0600 in a 0700 folder, unless given):
  ``acquire-task`` needs the secret's HMAC. The SuperExec, and so every ServerApp, gets
  ``FEDVLM_SIGNING_KEY`` from ``--signing-key``: every instruction the ServerApp sends is signed
  (``deploy.instruction_signing``).

It also gives a ServerApp ``--task-start-window`` seconds to start (Flower: 30) and fails its run,
saying why, after ``--task-starts`` starts that never began (``deploy.task_claims``): on a busy host
Flower's SuperExec otherwise starts one ServerApp after another and the run never begins. And it
holds a SuperNode's empty pull up to ``--pull-hold`` seconds, answering as soon as work for the node
is stored (``deploy.long_pulls``), instead of answering empty and being asked again; and reads a
node's key and sweeps expired task tokens when they change, not on every request
(``deploy.link_lookups``); and stores, reads and deletes a message's objects in set statements
rather than a few per object (``deploy.object_rows``).

The ServerApp's task token is on its process's command line (Flower's executor puts it there):
another account can read it with ``ps``, but cannot use it, since its requests are refused here.
What a root account on the host can do is outside any of this (docs/deployment.md, threat model).
Linux only (``/proc``); the check is made in this process, from the kernel's own table, with no
root needed.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from fedvlm.deploy import (
    link_lookups,
    log_beside_flower,
    long_pulls,
    object_batches,
    object_rows,
    object_uploads,
    scoped_middlewares,
    task_claims,
    whole_messages,
)
from fedvlm.deploy.instruction_signing import SIGNING_KEY_ENV, load_private
from fedvlm.utils.processes import tcp_sockets

log = logging.getLogger("fedvlm.superlink")
OWNED_BY_US = ("--isolation", "--superexec-auth-secret-file")  # flower-superlink flags this sets itself
ESTABLISHED = "01"  # /proc/net/tcp's state column


def _address(hex_address: str) -> tuple[str, int]:
    """``/proc/net/tcp``'s ``ADDR:PORT`` (the address in the kernel's word order) as text."""
    addr, port = hex_address.split(":")
    raw = bytes.fromhex(addr)
    # each 32-bit word is little-endian in the table
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _normal(host: str) -> str:
    ip = ipaddress.ip_address(host)
    return str(ip.ipv4_mapped) if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None else str(ip)


def socket_owner(client: tuple[str, int], server: tuple[str, int], tables: Sequence[str] = ()) -> int | None:
    """The uid of the open socket at ``client`` connected to ``server`` on this machine (None: no
    such socket here, e.g. a caller on another machine)."""
    want = ((_normal(client[0]), client[1]), (_normal(server[0]), server[1]))
    for cols in tcp_sockets(tables):
        # an open socket of a live process: established, with an inode (a closed one reads uid 0)
        if len(cols) < 10 or cols[3] != ESTABLISHED or cols[9] == "0":
            continue
        if (_address(cols[1]), _address(cols[2])) == want:
            return int(cols[7])
    return None


REFUSED_BODY = (
    b"this SuperLink serves only the accounts its operator named (fedvlm.deploy.superlink --allow-uid); "
    b"SuperNodes reach it through the Fleet gateway\n"
)
REFUSED = (
    b"HTTP/1.1 403 Forbidden\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    + f"content-length: {len(REFUSED_BODY)}\r\n\r\n".encode()
    + REFUSED_BODY
)


def account_protocol(uids: Collection[int]):
    """uvicorn's HTTP/1.1 protocol, serving a connection only when the socket that opened it belongs
    to one of ``uids``: the owner is read once per connection, when it is made (the kernel's
    table costs milliseconds to read, too much for every request of a keep-alive connection);
    a refused connection's first bytes are answered 403 without being parsed, and it is closed."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    allowed = frozenset(uids)

    class AccountGuarded(H11Protocol):
        _refused = False

        def connection_made(self, transport) -> None:
            peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            owner = socket_owner(tuple(peer[:2]), tuple(local[:2])) if peer and local else None
            if owner in allowed:
                super().connection_made(transport)
                return
            log.warning(
                "refused a connection from %s: the calling socket belongs to %s, not to the accounts this SuperLink "
                "serves (%s)",
                peer,
                f"uid {owner}" if owner is not None else "no account on this machine",
                ", ".join(str(u) for u in sorted(allowed)),
            )
            self._refused, self._raw = True, transport

        def data_received(self, data: bytes) -> None:
            if self._refused:
                self._raw.write(REFUSED)
                self._raw.close()
                return
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._refused:
                super().connection_lost(exc)

    return AccountGuarded


def check_flower(module: Any) -> str | None:
    """Why Flower's SuperLink command is not the one this wraps (None when it is)."""
    import inspect

    run = getattr(module, "_run_superlink_http_api", None)
    if getattr(module, "uvicorn", None) is None or run is None:
        return "it has no module-level uvicorn or _run_superlink_http_api"
    if "uvicorn.run(" not in inspect.getsource(run):
        return "_run_superlink_http_api no longer serves with uvicorn.run"
    return None


class GuardedUvicorn:
    """Stands in for ``uvicorn`` inside Flower's SuperLink command only: ``run`` serves the app
    over ``account_protocol``, believes no forwarding header, and first starts ``before``."""

    def __init__(self, uvicorn: Any, uids: Collection[int], before: Any):
        self.uvicorn, self.uids, self.before = uvicorn, uids, before

    def run(self, app: Any, **kwargs: Any) -> None:
        self.before()
        self.uvicorn.run(app, **{**kwargs, "proxy_headers": False, "http": account_protocol(self.uids)})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.uvicorn, name)


def _flag(args: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def superexec_command(args: Sequence[str], secret: Path) -> list[str]:
    """The SuperExec that takes this SuperLink's ServerApp tasks, with ``secret``."""
    host = _flag(args, "--host") or "127.0.0.1"
    port = _flag(args, "--port") or "8000"
    ca = _flag(args, "--ssl-ca-certfile")
    tls = ["--root-certificates", ca] if ca else ["--insecure"]
    command = [sys.executable, "-m", "fedvlm.deploy.task_reaping", *tls]  # flower-superexec, reaping its tasks
    command += ["--runtime-api-address", f"{host}:{port}", "--parent-pid", str(os.getpid())]
    return [*command, "--superexec-auth-secret-file", str(secret)]


def local_superlink_args() -> list[str]:
    """flower-superlink's arguments for the local simulation SuperLink, as Flower 1.42's CLI
    starts one (``flwr.cli.local_superlink._start_local_superlink``: its port, from
    ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``, its log and database under ``$FLWR_HOME``) but
    without ``--isolation``, which this command sets. `flwr run .` finds it answering on that port
    and uses it instead of starting its own, which every local account could use: a second
    account's run landed there and ran its code as the first account."""
    from flwr.cli.constant import LOCAL_SUPERLINK_HTTP_API_PORT
    from flwr.cli.local_superlink import _get_local_superlink_paths

    database, log_file = _get_local_superlink_paths()
    return [
        *("--insecure", "--simulation", "--host", "127.0.0.1", "--port", str(LOCAL_SUPERLINK_HTTP_API_PORT)),
        *("--log-file", str(log_file), "--log-rotation-interval-hours", "24", "--log-rotation-backup-count", "7"),
        *("--database", str(database)),
    ]


def _secret(given: Path | None) -> Path:
    if given is not None:
        return given
    folder = Path(tempfile.mkdtemp(prefix="fedvlm-superexec-"))  # 0700
    path = folder / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secrets.token_bytes(32))
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.superlink", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=[],
        help="an account that may reach the SuperLink (repeatable; default: the one running it)",
    )
    p.add_argument("--signing-key", type=Path, help="the ServerApp's signing key (server-signing.key)")
    p.add_argument("--superexec-secret", type=Path, help="the SuperExec's secret file (default: a new one each start)")
    p.add_argument(
        "--task-start-window",
        type=float,
        default=task_claims.START_WINDOW_S,
        help="seconds a ServerApp has to start before it is started again (Flower: 30)",
    )
    p.add_argument(
        "--task-starts",
        type=int,
        default=task_claims.MAX_STARTS,
        help="starts of one ServerApp that never began before its run is failed, saying why (Flower: no bound)",
    )
    p.add_argument(
        "--pull-hold",
        type=float,
        default=long_pulls.HOLD_S,
        help="seconds an empty SuperNode pull is held until work for it is stored (0: answered at once, as Flower)",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="the local SuperLink `flwr run .` uses for simulations, started as Flower's CLI starts it but serving "
        "only the allowed accounts (on a machine shared with other accounts)",
    )
    p.add_argument("superlink_args", nargs=argparse.REMAINDER, help="-- then flower-superlink's arguments")
    return p


def _start_local(p: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> None:
    """``--local``: this command again, with Flower's local simulation SuperLink's arguments on its
    command line, where ``python -m fedvlm.stop`` finds the SuperLink of an FLWR_HOME."""
    if rest:
        p.error("--local sets flower-superlink's arguments itself (Flower's local simulation SuperLink); give none")
    ours = [f"--allow-uid={u}" for u in args.allow_uid]
    ours += [f"--task-start-window={args.task_start_window}", f"--task-starts={args.task_starts}"]
    ours += [f"--pull-hold={args.pull_hold}"]
    ours += [f"--signing-key={args.signing_key}"] if args.signing_key else []
    ours += [f"--superexec-secret={args.superexec_secret}"] if args.superexec_secret else []
    again = [sys.executable, "-m", "fedvlm.deploy.superlink", *ours, "--", *local_superlink_args()]
    os.execv(sys.executable, again)


def _use_signing_key(p: argparse.ArgumentParser, key: Path) -> None:
    try:
        load_private(key)
    except (OSError, ValueError) as err:
        p.error(f"--signing-key: {err}")
    os.environ[SIGNING_KEY_ENV] = str(key.resolve())  # the SuperExec's and ServerApps' environment


def install_patches(task_start_window: float, task_starts: int, pull_hold: float) -> None:
    """This SuperLink's changes to Flower (``deploy.flower_patches``), before it builds its app;
    ValueError for a setting out of range."""
    task_claims.install(task_start_window, task_starts)
    long_pulls.install(pull_hold)
    object_batches.serve()
    whole_messages.serve()
    link_lookups.install()
    scoped_middlewares.install()
    object_rows.install()
    object_uploads.install()


def _install_patches(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        install_patches(args.task_start_window, args.task_starts, args.pull_hold)
    except ValueError as err:
        p.error(str(err))


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    rest = args.superlink_args[1:] if args.superlink_args[:1] == ["--"] else list(args.superlink_args)
    if args.local:
        _start_local(p, args, rest)
    taken = [f for f in OWNED_BY_US if _flag(rest, f) is not None or f in rest]
    if taken:
        p.error(f"{', '.join(taken)}: set by this command (its own SuperExec, with a secret); leave them out")
    if args.signing_key is not None:
        _use_signing_key(p, args.signing_key)
    log_beside_flower()
    import importlib

    flower = importlib.import_module(
        "flwr.superlink.cli.flower_superlink"
    )  # the package exports a function of that name
    problem = check_flower(flower)
    if problem is not None:
        raise SystemExit(
            f"Flower's SuperLink command is not the one fedvlm.deploy.superlink knows ({problem}): refusing to start a "
            "SuperLink every local account could use; install the Flower version in constraints.txt"
        )
    _install_patches(p, args)
    from flwr.supercore.exit import add_exit_handler

    secret = _secret(args.superexec_secret)

    def forget_secret() -> None:
        if args.superexec_secret is None:  # ours, made for this start only: no secret outlives its SuperLink
            shutil.rmtree(secret.parent, ignore_errors=True)

    # Stopped by a signal, uvicorn shuts the server down, restores the handler it found and raises
    # the signal again: with Python's default handler the process would die there, skipping
    # `finally`, and leave the secret behind. This handler turns that into an exit that unwinds;
    # where Flower exits through its own handlers instead, the secret goes before its force-exit timer.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    add_exit_handler(forget_secret, run_before_force_exit=True)
    uids = args.allow_uid or [os.getuid()]
    started: list[subprocess.Popen] = []

    def start_superexec() -> None:
        started.append(subprocess.Popen(superexec_command(rest, secret)))
        log.info("SuperExec (PID %d) takes this SuperLink's ServerApp tasks, with a secret", started[0].pid)

    flower.uvicorn = GuardedUvicorn(flower.uvicorn, uids, start_superexec)  # type: ignore[attr-defined]
    log.info("this SuperLink serves only uid(s) %s", ", ".join(str(u) for u in uids))
    sys.argv = ["flower-superlink", *rest, "--isolation", "process", "--superexec-auth-secret-file", str(secret)]
    try:
        flower.flower_superlink()
    finally:
        for proc in started:
            proc.terminate()
        forget_secret()
    return 0


if __name__ == "__main__":
    sys.exit(main())
