"""What a SuperNode takes from the SuperLink: only runs of the apps its organisation pinned, and
only as ClientApps, refused inside the SuperNode before anything of the run is stored.

Flower 1.42's SuperNode, for the first message of a run it does not know, asks the SuperLink
for the run and its FAB (the app's zip), stores both and creates a task for the message; its
SuperExec then starts, for that task, whatever the task type names. The FAB decides the type: a
FAB that declares an ``agentapp`` component makes an AgentApp run, and the SuperExec starts
Flower's ``flwr-agentapp``, which installs and imports the FAB. A check in the ClientApp
process alone (``deploy.pinned_app``) therefore misses every task type but one. Every type, in
1.42 and later, reaches a node's machine through one place: the SuperNode's
``_pull_and_store_message`` (``flwr/supernode/start_client_internal.py``), the only caller of
the SuperLink's GetFab on a node. ``install`` wraps it:

- the run (``get_run``) must be one the SuperNode would start as a ClientApp
  (``primary_task_type`` not AgentApp: the same test Flower's loop applies when it picks the
  task type);
- the FAB (``get_fab``) must have a SHA-256, computed here from its bytes, that the organisation
  pinned (``pinned_app.check_fab``);
- otherwise the SuperNode stores neither the run nor its FAB, creates no task and starts no
  process, and answers the message with an error reply (``ErrorCode.INVALID_FAB``, the reason
  naming the app and the pins), exactly as Flower answers a FAB its ``--trusted-entities``
  check refuses. Every later message of that run is refused again, since the run was never
  stored.

The wrap is installed only where Flower's function still reads as described (``check_flower``);
a Flower that reads differently makes the node refuse to start rather than run unguarded
(``GateUnavailable``): here a missing patch would cost security, not speed.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

from fedvlm.deploy import flower_patches
from fedvlm.deploy.pinned_app import AppNotPinned, check_fab

log = logging.getLogger("fedvlm.supernode")
NEEDED = ("receive", "get_run", "get_fab", "state", "object_store")  # the keywords the wrap replaces or reads


class GateUnavailable(RuntimeError):
    """The installed Flower's SuperNode is not the one the gate was written for."""


class NotAClientApp(PermissionError):
    """A run this node would not start as a ClientApp (an AgentApp run, or any other)."""


def check_flower(module: ModuleType) -> str | None:
    """Why ``module`` is not the SuperNode loop the gate wraps (None when it is)."""
    pull = getattr(module, "_pull_and_store_message", None)
    if pull is None or not hasattr(module, "_insert_message"):
        return "it has no _pull_and_store_message or _insert_message"
    params = inspect.signature(pull).parameters
    missing = [p for p in NEEDED if p not in params]
    if missing:
        return f"_pull_and_store_message takes no {', '.join(missing)}"
    source = inspect.getsource(module)
    if source.count("get_fab(") != 1 or "primary_task_type == TaskType.AGENT_APP" not in source:
        return "its loop no longer fetches each run's FAB once, or picks task types differently"
    return None


def check_run(run: Any) -> None:
    """``NotAClientApp`` unless the SuperNode would start ``run``'s tasks as ClientApps."""
    from flwr.supercore.constant import TaskType

    if run.primary_task_type == TaskType.AGENT_APP:
        raise NotAClientApp(
            f"run {run.run_id} ({run.fab_id} {run.fab_version}) is an AgentApp run: this node runs only the ClientApps "
            "of the apps its organisation pinned; refused before its app was fetched"
        )


def gate(
    pull: Callable[..., int | None], pins: frozenset[str], insert: Callable[..., None]
) -> Callable[..., int | None]:
    """``pull`` (Flower's ``_pull_and_store_message``) that refuses what the module docstring
    says; ``insert``: Flower's ``_insert_message``, which queues the refusal as the reply."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    def gated(*args: Any, **kwargs: Any) -> int | None:
        bound = inspect.signature(pull).bind(*args, **kwargs)
        seen: dict[str, Any] = {}
        receive, get_run, get_fab = (bound.arguments[k] for k in ("receive", "get_run", "get_fab"))

        def receive_seen():
            pulled = receive()
            seen["message"] = pulled[0] if pulled is not None else None
            return pulled

        def get_run_checked(run_id: int):
            run = get_run(run_id)
            check_run(run)
            return run

        def get_fab_checked(fab_hash: str, run_id: int):
            fab = get_fab(fab_hash, run_id)
            check_fab(fab.content, pins)
            return fab

        bound.arguments.update(receive=receive_seen, get_run=get_run_checked, get_fab=get_fab_checked)
        try:
            return pull(*bound.args, **bound.kwargs)
        except (AppNotPinned, NotAClientApp) as refused:
            message = seen["message"]
            reason = f"{type(refused).__name__}: {refused}"
            log.error("refused message %s of run %s: %s", message.metadata.message_id, message.metadata.run_id, reason)
            reply = Message(Error(ErrorCode.INVALID_FAB, reason), reply_to=message)
            insert(reply, bound.arguments["state"], bound.arguments["object_store"])
            return message.metadata.run_id

    return gated


def install(pins: Collection[str]) -> None:
    """Gate this process's SuperNode to ``pins`` (``GateUnavailable`` where Flower differs)."""
    import flwr
    import flwr.supernode.start_client_internal as loop

    if not pins:
        raise ValueError("a SuperNode gate needs at least one pinned app")
    problem = check_flower(loop)
    if problem is not None:
        raise GateUnavailable(
            f"Flower {flwr.__version__}'s SuperNode is not the one fedvlm's gate knows ({problem}): refusing to start "
            "a SuperNode that would run any app it is sent; install the Flower version in constraints.txt"
        )
    flower_patches.note_version("supernode-gate")
    loop._pull_and_store_message = gate(loop._pull_and_store_message, frozenset(pins), loop._insert_message)
    log.info("this SuperNode runs only the ClientApps of the pinned app(s) %s", ", ".join(sorted(pins)))
