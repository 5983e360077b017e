"""Flower's SuperNode with its two polling waits set by the operator instead of hard-coded.

    python -m fedvlm.deploy.supernode_polling --pin <sha256> [--idle-poll 0.5] [--reply-poll 0.1] \\
        [--reply-timeout 3600] -- <flower-supernode's arguments>

It also gates the SuperNode to the pinned apps (``deploy.supernode_gate``): a run of any other
app, or of any task type but a ClientApp, is refused before anything of it is stored.

Flower 1.42's SuperNode (``flwr/supernode/start_client_internal.py``) runs one loop: pull a
message from the SuperLink; when there is none, sleep 3 s; when there is one, wait for the
ClientApp's reply, looking every 0.5 s, then push it. Neither wait can be configured. A message
that reaches the SuperLink just after a pull waits up to 3 s before the node sees it, and a reply
waits up to 0.5 s before it leaves: with two messages per node per round, that is up to 7 s of
every deployed round spent asleep (docs/results/deployment.md, 'Deployment speed: a warm node
worker'; this patch's row in ``deploy.flower_patches``).

This runs Flower's own SuperNode command in this process with one change: inside that one module,
``time`` is a stand-in whose ``sleep(3)`` sleeps ``--idle-poll`` seconds and whose ``sleep(0.5)``
sleeps ``--reply-poll`` seconds; every other use of ``time`` there, and everything outside that
module, is untouched. Nothing about what the node runs, accepts or sends changes, only how soon it
looks again; the SuperLink sees one more cheap pull per node every ``--idle-poll`` seconds. The
reply wait also ends as soon as a reply is stored in the node's state (``InMemoryNodeState.
store_message``, which the ClientApp's push reaches): it looks again at once instead of up to
``--reply-poll`` seconds later (50 ms a message on average at 0.1 s), and every ``--reply-poll``
seconds still, whatever wakes it.

The reply wait is also bounded. Flower's waits for the ClientApp's reply (and for the reply's
parts) with no end: a task whose token another local account took (spawn mode puts it on the
command line) and never answered kept the node out of the federation until it was restarted.
After ``--reply-timeout`` seconds (default 3600, six times the server's default round-timeout:
a reply later than the server's wait is one the round no longer takes) the node logs the loss and
goes back to pulling; the server counts the node's reply as missing, as for any lost reply. The
bound is raised out of the stand-in's reply wait as ``ReplyOverdue``, a ``BaseException`` so that
Flower's ``except Exception`` around a send does not swallow it, and caught around Flower's
``_push_messages`` (``bound_replies``). Nothing is sent and nothing is charged by giving up: a
node's ledger is written by its ClientApp when it trains, never by this wait.

The change is made only when Flower's module still reads as described (``check_flower``); any
other Flower version runs unchanged, with a warning, so a Flower upgrade costs speed, never
correctness. ``tests/unit/test_supernode_polling.py`` fails when the installed Flower no longer
matches, which is the signal to revisit this module.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType

from fedvlm.deploy import (
    flower_patches,
    log_beside_flower,
    long_pulls,
    object_batches,
    supernode_gate,
    task_input,
    whole_messages,
)
from fedvlm.deploy.pinned_app import parse_pin

log = logging.getLogger("fedvlm.supernode")

# the waits in Flower 1.42's SuperNode loop, as written there, and how often each is written
IDLE_WAIT, REPLY_WAIT = 3, 0.5
FLOWER_SLEEPS = {"time.sleep(3)": 1, "time.sleep(0.5)": 2}


class ReplyOverdue(BaseException):
    """The ClientApp's reply did not come within ``--reply-timeout`` (see the module's text)."""


class PollingClock:
    """Stands in for the ``time`` module inside Flower's SuperNode loop only: its two fixed waits
    become ``idle`` and ``reply`` seconds; every other attribute is the real ``time``'s. While a
    reply is awaited (``deadline`` set by ``bound_replies``), a reply wait past it raises
    ``ReplyOverdue``."""

    deadline: float | None = None

    def __init__(self, idle: float, reply: float, replied: threading.Event | None = None):
        if not (0 < idle <= IDLE_WAIT and 0 < reply <= REPLY_WAIT):
            raise ValueError(
                f"--idle-poll must be in (0, {IDLE_WAIT}] and --reply-poll in (0, {REPLY_WAIT}] seconds "
                f"(Flower's own waits are the upper ends); got {idle} and {reply}"
            )
        self.waits = {IDLE_WAIT: idle, REPLY_WAIT: reply}
        self.replied = replied  # set when a reply is stored (``noting_replies``)

    def sleep(self, seconds: float) -> None:
        if seconds == REPLY_WAIT and self.deadline is not None and time.monotonic() >= self.deadline:
            raise ReplyOverdue
        if seconds == REPLY_WAIT and self.replied is not None:
            # cleared after the wait and before the loop looks again: a reply stored in between is
            # one that look finds, so no wake is lost
            self.replied.wait(self.waits[REPLY_WAIT])
            self.replied.clear()
            return
        time.sleep(self.waits.get(seconds, seconds))

    def __getattr__(self, name: str):
        return getattr(time, name)


def check_flower(module: ModuleType) -> str | None:
    """Why ``module`` is not the SuperNode loop this shim was written against, or None when it is:
    it must use the module-level ``time`` and hold exactly the two waits, as many times as
    Flower 1.42 does."""
    if getattr(module, "time", None) is not time:
        return "it does not use the module-level `time`"
    source = inspect.getsource(module)
    for call, count in FLOWER_SLEEPS.items():
        if source.count(call) != count:
            return f"it has {source.count(call)} `{call}` (expected {count})"
    if why := flower_patches.lacking(module, "_push_messages"):  # the reply wait this bounds
        return why
    if "state.get_messages_legacy(is_reply=True)" not in inspect.getsource(module._push_messages):
        return "its `_push_messages` does not look for a reply in the node's state"
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    return flower_patches.lacking(InMemoryNodeState, "store_message")  # where a reply is stored


def noting_replies(store: Callable, replied: threading.Event) -> Callable:
    """``InMemoryNodeState.store_message``, setting ``replied`` after it stored a reply."""

    @functools.wraps(store)
    def stored(self, message, *args, **kwargs):
        found = store(self, message, *args, **kwargs)
        if message.metadata.reply_to_message_id:
            replied.set()
        return found

    return stored


def bound_replies(push: Callable[..., None], clock: PollingClock, timeout: float) -> Callable[..., None]:
    """Flower's ``_push_messages`` (wait for the ClientApp's reply, then send it), given up after
    ``timeout`` seconds with the loss logged, so that the node pulls its next message."""

    @functools.wraps(push)
    def bounded(*args, **kwargs) -> None:
        clock.deadline = time.monotonic() + timeout
        try:
            push(*args, **kwargs)
        except ReplyOverdue:
            log.error(
                "no reply from this node's ClientApp within --reply-timeout (%g s): the task was taken and not "
                "answered (by another local account? docs/deployment.md, section 4) or its training outlasted the "
                "bound (raise --reply-timeout). The server counts this node's reply as missing; the node goes back "
                "to the federation",
                timeout,
            )
        finally:
            clock.deadline = None

    return bounded


def install(idle: float, reply: float, reply_timeout: float = 3600.0) -> bool:
    """Put the stand-in into Flower's SuperNode loop, its reply wait bounded by ``reply_timeout``
    seconds; False (with a warning) when Flower's module is not the one this was written for,
    which then runs with its own waits, unbounded."""
    if not reply_timeout > 0:
        raise ValueError(f"--reply-timeout must be a positive number of seconds; got {reply_timeout}")
    import flwr
    import flwr.supernode.start_client_internal as loop

    problem = check_flower(loop)
    if problem is not None:
        log.warning(
            "Flower %s's SuperNode loop is not the one fedvlm's polling shim knows (%s): running it with its own "
            "waits (3 s idle, 0.5 s per reply look)",
            flwr.__version__,
            problem,
        )
        return False
    flower_patches.note_version("supernode-waits")
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    replied = threading.Event()
    clock = PollingClock(idle, reply, replied)
    InMemoryNodeState.store_message = noting_replies(InMemoryNodeState.store_message, replied)  # type: ignore[method-assign]
    loop.time = clock  # type: ignore[assignment]  # a stand-in for the module
    loop._push_messages = bound_replies(loop._push_messages, clock, reply_timeout)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The pins and the two waits, as this command and the restarting supervisor (deploy.supernode) take them."""
    p.add_argument(
        "--pin",
        action="append",
        required=True,
        type=parse_pin,
        help="SHA-256 of an app this node may run (repeatable; `python -m fedvlm.deploy.pinned_app hash APP`)",
    )
    p.add_argument("--idle-poll", type=float, default=0.5, help="seconds between empty pulls (Flower: 3)")
    p.add_argument("--reply-poll", type=float, default=0.1, help="seconds between looks for a reply (Flower: 0.5)")
    p.add_argument(
        "--reply-timeout",
        type=float,
        default=3600.0,
        help="seconds to wait for the ClientApp's reply to one message before giving it up (Flower: forever)",
    )


def warn_without_limit(supernode_args: Sequence[str]) -> bool:
    """Say loudly when this node's config states no privacy limit (True when it states one):
    without one it trains with whatever noise the server sets (docs/privacy.md, "A node's own
    limit"); a bad limit is the handshake's to refuse, with its reason."""
    from flwr.common.config import parse_config_args

    given = [a.split("=", 1)[1] for a in supernode_args if a.startswith("--node-config=")]
    given += [b for a, b in zip(supernode_args, supernode_args[1:], strict=False) if a == "--node-config"]
    try:
        config = parse_config_args(given)
    except Exception:  # noqa: BLE001 - Flower's own parser reports a malformed node config when it starts
        return False
    if "max-epsilon" in config:
        return True
    log.warning(
        "THIS NODE STATES NO PRIVACY LIMIT: it trains with whatever noise the server's run config sets, and its "
        "records may spend any epsilon. Add max-epsilon=<limit> delta=<delta> state-dir=<folder> to its "
        "--node-config (docs/deployment.md, section 4)"
    )
    return False


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.supernode_polling", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then flower-supernode's arguments")
    args = p.parse_args(argv)
    log_beside_flower()
    supernode_gate.install(args.pin)  # before Flower's SuperNode pulls anything
    try:
        clock_ok = install(args.idle_poll, args.reply_poll, args.reply_timeout)
    except ValueError as err:
        p.error(str(err))
    if clock_ok:
        log.info(
            "SuperNode polling: every %.2f s when idle, every %.2f s for a reply, given up after %g s",
            args.idle_poll,
            args.reply_poll,
            args.reply_timeout,
        )
    object_batches.install()  # a message's objects in one request
    whole_messages.install()  # with the message itself, the reply with its objects
    long_pulls.install_tasks()  # its SuperExec's look for a ClientApp to start, held until one is there
    object_batches.serve(fleet_api=False)  # as its ClientApps ask for theirs
    task_input.serve()  # and their task in one call, without the FAB this node has installed
    from flwr.supernode.cli.flower_supernode import flower_supernode

    rest = args.supernode_args[1:] if args.supernode_args[:1] == ["--"] else args.supernode_args
    warn_without_limit(rest)
    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
