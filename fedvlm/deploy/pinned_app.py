"""What a node will run: only the app (Flower FAB) its organisation pinned, checked before any of
the app's code is unpacked or imported.

A Flower SuperNode executes the ClientApp of whatever app a run carries: the run's FAB (a zip of
the app's files) comes from the SuperLink, and Flower unpacks and imports it in a fresh
``flwr-clientapp`` process. Flower's own check, ``flower-supernode --trusted-entities``, verifies
signatures that Flower Hub attaches to the apps it distributes; an app submitted from a
researcher's checkout (``flwr run .``) carries none and is then refused outright, so that check
cannot pin this project's app. This module is the project-side layer:

- ``hash``: the SHA-256 of the FAB that ``flwr run <app dir>`` builds (Flower builds it
  deterministically: fixed timestamps, sorted files), or of a ``.fab`` file; the researcher
  publishes it with the release the organisations review;
- ``exec``: runs Flower's own SuperExec (``flower-superexec``, the process that starts a
  ClientApp process for every task of a SuperNode started with ``--isolation process``), with
  one change: the ClientApp process it starts is ``fedvlm-clientapp``, forked from a warm fork
  server on Linux (``deploy.clientapp_forks``; ``--clientapp-start spawn``: a new process, as
  Flower starts it), and it looks for tasks every ``--task-poll`` seconds (Flower: 1 s);
- ``fedvlm-clientapp`` is Flower's ``flwr-clientapp`` with two checks first: the SHA-256 of the
  run's FAB, computed from its bytes (never the hash the run claims: here, or by the node's own
  SuperNode when it left out a FAB installed on the node, ``deploy.task_input``), must be one the
  organisation pinned; and, with ``exec --server-key``, the message must carry the signature of
  the federation's ServerApp (``deploy.instruction_signing``). Otherwise the task ends with an
  error reply naming what failed, before the FAB is unpacked; nothing of the app ran.

The SuperNode itself checks the FAB against the same pins first, for every kind of run
(``deploy.supernode_gate``, ``python -m fedvlm.deploy.supernode --pin``); this is the second
layer, and the only place a message's content is at hand.

    python -m fedvlm.deploy.pinned_app hash .                      # the researcher, once per release
    python -m fedvlm.deploy.pinned_app exec --pin <sha256> --server-key server-signing.pub -- \\
        --runtime-api-address 127.0.0.1:9094 --insecure \\
        --superexec-auth-secret-file secret                        # the organisation, beside its SuperNode
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import logging
import os
import re
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedvlm.deploy import flower_patches, log_beside_flower, object_batches, task_input, task_reaping

PINS_ENV = "FEDVLM_PINNED_APPS"  # how exec hands the pins to the ClientApp processes it starts
SERVER_KEYS_ENV = "FEDVLM_SERVER_KEYS"  # and the ServerApp keys whose signatures they accept
SERVED_ENV = "FEDVLM_SERVED_DIR"  # and where they keep the signed messages the node served
DEFAULT_SERVED = "~/.local/state/fedvlm/served"
CLIENTAPP_COMMAND = "fedvlm-clientapp"  # pyproject [project.scripts]
CLIENTAPP_ENTRY = "fedvlm.deploy.pinned_app:clientapp_main"  # what that script runs
# The module of this package's ClientApp (pyproject [tool.flwr.app.components]), which every
# ClientApp process of a pinned run loads: the fork server imports it once (clientapp_forks'
# ``WARM``) instead of every ClientApp importing it again (0.4 s of each secure stage's 0.6 s on a
# node here). The code that runs is the same: a child's ``fedvlm.*`` import resolves through the
# ``fedvlm`` package the fork server imported already (this module is in it), never the FAB's copy.
# With it, the Flower module whose Runtime API calls a child's object batches check before they
# replace them (``object_batches.install_clients``; 0.016 s of a child's CPU under a profiler),
# and what a child still imported under a profiler (2026-12-04, 4 secure nodes: 4 ms of its
# 124): the signature check, the protobuf descriptors Flower's serde loads late, and the code
# page zipfile decodes the FAB's names with.
WARM = (
    "fedvlm.client_app.app",
    "flwr.superlink.grid.http_grid",
    "fedvlm.deploy.instruction_signing",
    "google.protobuf.descriptor_pb2",
    "encodings.cp437",
)
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # Flower's SuperExec reads it (seconds, default 1)
_SHA256 = re.compile(r"^(sha256:)?([0-9a-f]{64})$")


class AppNotPinned(PermissionError):
    """The run's app is not one this node's organisation pinned."""


def fab_hash(fab: bytes) -> str:
    return hashlib.sha256(fab).hexdigest()


def fab_identity(fab: bytes) -> tuple[str, str]:
    """('publisher/name', version) from the FAB's ``pyproject.toml``, read from the zip without
    running anything and without Flower's validation; raises where the FAB names no app."""
    import tomli  # Flower's own TOML reader (Python 3.10 has no tomllib)
    from flwr.common.config import get_metadata_from_config

    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        return get_metadata_from_config(tomli.loads(archive.read("pyproject.toml").decode("utf-8")))


def fab_name(fab: bytes) -> str:
    """'publisher/name version', or '(unnamed app)' when the FAB names none that parses."""
    try:
        return " ".join(fab_identity(fab))
    except Exception:  # noqa: BLE001 - a name for the refusal message only
        return "(unnamed app)"


def parse_pin(text: str) -> str:
    m = _SHA256.match(text.strip().lower())
    if not m:
        raise ValueError(f"{text!r} is not a SHA-256 (64 hex digits, optionally prefixed 'sha256:')")
    return m.group(2)


def pinned_from_env() -> frozenset[str]:
    """The pins ``exec`` handed down; refused (fail closed) when there are none."""
    raw = os.environ.get(PINS_ENV, "")
    pins = frozenset(parse_pin(p) for p in raw.split(",") if p.strip())
    if not pins:
        raise AppNotPinned(
            f"{CLIENTAPP_COMMAND} runs an app only under `python -m fedvlm.deploy.pinned_app exec --pin <sha256>`, "
            f"which names the apps this node may run; {PINS_ENV} is empty"
        )
    return pins


def check_fab(fab: bytes, pins: frozenset[str]) -> str:
    """``fab``'s SHA-256; ``AppNotPinned`` unless it is one of ``pins``."""
    return check_digest(fab_hash(fab), pins, fab_name(fab))


def check_task_fab(fab: bytes, withheld: str | None, pins: frozenset[str], name: str) -> str:
    """The SHA-256 of a task's FAB (``AppNotPinned`` unless it is one of ``pins``): of ``fab``'s
    bytes, or ``withheld``, the digest the node's SuperNode computed of the bytes it left out
    (``task_input``) when ``fab`` came without them."""
    if withheld and not fab:
        return check_digest(withheld, pins, name)
    return check_fab(fab, pins)


def check_digest(digest: str, pins: frozenset[str], name: str) -> str:
    """``digest`` (a FAB's SHA-256, computed from its bytes on this node); ``AppNotPinned`` unless
    it is one of ``pins``."""
    if digest not in pins:
        raise AppNotPinned(
            f"this node runs only the app(s) its organisation pinned (sha256 {', '.join(sorted(pins))}); this run's "
            f"app {name} has sha256 {digest}: refused before any of its code was unpacked or run"
        )
    return digest


def installed_app(fab: bytes, digest: str | None = None) -> Path | None:
    """Where Flower has installed exactly this FAB already (None: nowhere yet); ``digest``, its
    SHA-256 where the caller has it. Flower's ``install_from_fab`` extracts the whole FAB into a
    temporary folder, checks every file's hash and validates its ``pyproject.toml`` before it finds
    the app installed and returns its folder, for every message (0.2 s of a node's CPU for this
    app's FAB): the same bytes pass the same checks, so an installed folder named by this FAB's
    hash (``get_project_dir``, where Flower installs and loads it) is returned as Flower would
    return it. The name is read from the FAB's ``pyproject.toml`` without Flower's validation
    (its requirement parsing was 16 ms of each ClientApp's CPU): the caller checked the bytes
    against the node's pins first, and the folder exists only because Flower's install validated
    a FAB of that publisher, name, version and hash prefix (Flower's own folder name; a FAB it
    would refuse finds no folder, and Flower's install then reports it)."""
    from flwr.common.config import get_project_dir

    try:
        path = get_project_dir(*fab_identity(fab), digest or fab_hash(fab))
    except Exception:  # noqa: BLE001 - a FAB Flower cannot name: let Flower's install report it
        return None
    return path if path.is_dir() else None


def build_hash(app: Path) -> tuple[str, str]:
    """(sha256, name) of the FAB Flower builds from ``app`` (a directory), or of a .fab file;
    ValueError naming ``app`` where it is neither (a pin of a truncated download pins nothing)."""
    from flwr.common.config import get_fab_config

    if app.is_file():
        fab = app.read_bytes()
        try:
            get_fab_config(fab)  # a zip holding the app's pyproject.toml, as `flwr run` sends it
        except Exception as err:  # noqa: BLE001 - Flower's own reader says what is wrong; named here
            raise ValueError(f"{app} is not a Flower app (.fab) file: {err}; build it again") from err
        return fab_hash(fab), fab_name(fab)
    if not (app / "pyproject.toml").is_file():
        raise ValueError(f"{app} is neither a .fab file nor an app folder with a pyproject.toml")
    from flwr.cli.build import build_fab_from_disk

    try:
        fab = build_fab_from_disk(app)
    except Exception as err:  # noqa: BLE001 - Flower's build says why; named with the folder
        raise ValueError(f"{app}: Flower cannot build the app: {type(err).__name__}: {err}") from err
    return fab_hash(fab), fab_name(fab)


def server_keys_from_env() -> list:
    """The ServerApp keys ``exec --server-key`` pinned (none: messages are not verified)."""
    return list(_server_keys(os.environ.get(SERVER_KEYS_ENV, "")))


@functools.cache  # read once by the fork server (``prepare``): its children start with the keys parsed
def _server_keys(paths: str) -> tuple:
    """The keys at ``paths``, as they were when the SuperExec's ClientApps began: a key file
    replaced later takes effect when the operator restarts ``exec``, as its ``--server-key``
    list does (that list is this cache's key)."""
    from fedvlm.deploy.instruction_signing import load_public

    return tuple(load_public(Path(p)) for p in paths.split(os.pathsep) if p)


@functools.cache  # Flower's code in this process does not change; the fork server's answer is its children's
def check_flower() -> str | None:
    """Why Flower's ClientApp runtime and SuperExec are not the ones the pin is checked in (None:
    they are): the runtime must pull the task and unpack its FAB through its module-level
    ``pull_task_input`` and ``install_from_fab`` (a pin check put anywhere else might never be
    called), and the SuperExec must start ClientApps with the command its table names and take
    the task types its plugin lists."""
    import inspect

    import flwr.supernode.runtime.run_clientapp as runtime
    from flwr.supercore import constant
    from flwr.supercore.superexec.plugin.base_exec_plugin import AutoExecPlugin, BaseExecPlugin

    run = inspect.getsource(runtime.run_clientapp)
    if "pull_task_input(client)" not in run or "install_from_fab(" not in run:
        return "run_clientapp no longer pulls and unpacks through pull_task_input and install_from_fab"
    if why := flower_patches.lacking(runtime, "install_from_fab", "pull_task_input"):
        return why
    if constant.TaskType.CLIENT_APP not in constant.TASK_TYPE_TO_COMMAND:
        return "the SuperExec's command table has no ClientApp"
    if not issubclass(AutoExecPlugin, BaseExecPlugin) or "self.supported_task_types" not in inspect.getsource(
        BaseExecPlugin
    ):
        return "the SuperExec's plugin no longer checks supported_task_types"
    return None


def prepare() -> None:
    """What every ClientApp process would otherwise do again with the same result, done once by
    the fork server before it forks (``clientapp_forks``): the check of Flower's runtime (it reads
    Flower's source, and imports the SuperExec's plugins) and the digest of this package's source
    the node worker compares (it reads every file), and the pinned ServerApp keys parsed (3.5 ms
    a child). A child runs the code the server holds, so these answers are the child's own; they
    cost a third of a forked ClientApp's CPU. The pin still
    fails closed: a server whose Flower fails the check exits before its first fork, and the
    SuperExec's ClientApps then start as new processes, each of which checks and refuses."""
    from fedvlm.client_app.worker import code_digest

    _require_flower()
    code_digest()
    server_keys_from_env()
    task_input.check_flower()


def _require_flower() -> None:
    """The pin fails closed: a Flower whose runtime reads otherwise runs no ClientApp here."""
    problem = check_flower()
    if problem is not None:
        raise SystemExit(
            f"Flower's ClientApp runtime is not the one fedvlm pins apps in ({problem}): refusing to run any app; "
            "install the Flower version in constraints.txt"
        )


def clientapp_main() -> None:
    """``fedvlm-clientapp``: Flower's ``flwr-clientapp``, with the run's FAB checked against the
    pins and the message's signature against the pinned ServerApp keys, after Flower pulled the
    message and before it unpacks the FAB (its ``install_from_fab`` is the first thing that
    touches the FAB's content). A refusal raises inside Flower's task, which replies with the
    error; nothing of the app ran."""
    import flwr.supernode.runtime.run_clientapp as runtime
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    from fedvlm.deploy.instruction_signing import verify

    _require_flower()
    install, pull = runtime.install_from_fab, runtime.pull_task_input
    from fedvlm.deploy.instruction_signing import Served

    keys = server_keys_from_env()
    pulled: dict[str, Any] = {}
    served = Served(Path(os.environ[SERVED_ENV])) if os.environ.get(SERVED_ENV) else None

    def pull_kept(client):
        client.PullTaskInput = puller = task_input.Puller(client, pinned_from_env())  # the task in one call
        message, context, run, fab = pull(client)
        pulled.update(message=message, run=run, withheld=puller.withheld)
        return message, context, run, fab

    def install_pinned(fab_file: Path | bytes, install_dir: Path | None = None, skip_prompt: bool = False) -> Path:
        fab = fab_file.read_bytes() if isinstance(fab_file, Path) else fab_file
        run, withheld = pulled["run"], None if fab else pulled["withheld"]
        digest = check_task_fab(fab, withheld, pinned_from_env(), f"{run.fab_id} {run.fab_version}")
        if keys:
            verify(pulled["message"], keys, served)
        if withheld:
            return task_input.installed(run.fab_id, run.fab_version, digest)
        installed = installed_app(fab, digest) if install_dir is None and skip_prompt else None
        return installed if installed is not None else install(fab_file, install_dir, skip_prompt)

    runtime.pull_task_input = pull_kept
    runtime.install_from_fab = install_pinned
    object_batches.install_clients()  # a message's objects in one request to the SuperNode
    flwr_clientapp()


def _exec(
    pins: Sequence[str],
    server_keys: Sequence[Path],
    superexec_args: Sequence[str],
    fork: bool,
    task_poll: float,
    served: Path,
) -> None:
    """Flower's SuperExec, starting ``fedvlm-clientapp`` for ClientApp tasks (forked, with ``fork``)."""
    from flwr.supercore import constant
    from flwr.supercore.cli.flower_superexec import flower_superexec

    _require_flower()
    command = Path(sys.executable).parent / CLIENTAPP_COMMAND
    if not command.exists():
        raise SystemExit(f"{command} is missing: install this project (pip install -e .) in this environment")
    os.environ[PINS_ENV] = ",".join(pins)  # inherited by every ClientApp process it starts
    os.environ[SERVER_KEYS_ENV] = os.pathsep.join(str(Path(k).resolve()) for k in server_keys)
    os.environ[SERVED_ENV] = str(served.expanduser().resolve())
    os.environ.setdefault(TASK_POLL_ENV, str(task_poll))  # an operator's own setting wins
    commands: dict[Any, str] = constant.TASK_TYPE_TO_COMMAND  # keyed by a StrEnum (Python 3.11)
    commands[constant.TaskType.CLIENT_APP] = str(command)
    # A node's tasks are ClientApps: the SuperNode refuses every other kind of run before it
    # stores it (deploy.supernode_gate), and this executor takes no other task type either.
    from flwr.supercore.superexec.plugin.base_exec_plugin import AutoExecPlugin

    client_app: Any = constant.TaskType.CLIENT_APP  # a StrEnum member, typed as its str value by mypy
    AutoExecPlugin.supported_task_types = frozenset({client_app})
    if fork:
        from fedvlm.deploy.clientapp_forks import install

        # before the SuperExec opens a connection: the fork server starts single-threaded
        install(str(command), CLIENTAPP_ENTRY)
    else:
        task_reaping.install()  # a spawned ClientApp that finished is reaped at once
    sys.argv = ["flower-superexec", *superexec_args]
    flower_superexec()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.pinned_app", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hash", help="the SHA-256 of the app `flwr run APP` sends (or of a .fab file)")
    h.add_argument("app", type=Path, nargs="?", default=Path("."))
    e = sub.add_parser("exec", help="Flower's SuperExec that runs only the pinned apps (args after --)")
    e.add_argument("--pin", action="append", required=True, help="SHA-256 of an app this node may run (repeatable)")
    e.add_argument(
        "--server-key",
        action="append",
        type=Path,
        default=[],
        help="the federation's ServerApp key (server-signing.pub): run only messages it signed (repeatable)",
    )
    e.add_argument(
        "--accept-unsigned-instructions",
        action="store_true",
        help="run without --server-key: any message of a pinned app that reaches this node runs, whoever pushed it",
    )
    e.add_argument(
        "--clientapp-start",
        choices=("fork", "spawn"),
        default="fork" if sys.platform.startswith("linux") else "spawn",
        help="fork each ClientApp from a warm fork server (Linux default) or start it as a new process (Flower's way)",
    )
    e.add_argument("--task-poll", type=float, default=0.2, help="seconds between looks for a task (Flower: 1)")
    e.add_argument(
        "--served-dir",
        type=Path,
        default=Path(DEFAULT_SERVED),
        help="where the node keeps the signed messages it served, so that a replay is refused (owner-only; "
        f"default {DEFAULT_SERVED})",
    )
    e.add_argument("superexec_args", nargs=argparse.REMAINDER, help="-- then flower-superexec's arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.command == "hash":
        try:
            digest, name = build_hash(args.app)
        except (ValueError, OSError) as err:
            p.error(str(err))
        print(f"sha256:{digest}  {name}")
        return 0
    try:
        pins = [parse_pin(x) for x in args.pin]
    except ValueError as err:
        p.error(str(err))
    try:
        from fedvlm.deploy.instruction_signing import load_public

        for key in args.server_key:
            load_public(key)
    except (OSError, ValueError) as err:
        p.error(f"--server-key: {err}")
    if not args.server_key and not args.accept_unsigned_instructions:
        p.error(
            "--server-key is required: pin the federation's server-signing.pub so that this node acts only on its "
            "ServerApp's instructions (or say --accept-unsigned-instructions to run any message of a pinned app "
            "that reaches it, whoever pushed it)"
        )
    rest = args.superexec_args[1:] if args.superexec_args[:1] == ["--"] else args.superexec_args
    log_beside_flower()
    if not args.server_key:
        logging.getLogger("fedvlm.exec").warning(
            "--accept-unsigned-instructions: this node runs any message of a pinned app that reaches it, whoever "
            "pushed it"
        )
    _exec(pins, args.server_key, rest, args.clientapp_start == "fork", args.task_poll, args.served_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
