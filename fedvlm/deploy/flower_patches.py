"""Every change this project makes to Flower at run time, in one table.

Flower 1.42 hard-codes a few things a deployment of this project needs otherwise: how long a
SuperNode sleeps between looks for work, how soon an object is asked for again, a new Python
process for every ClientApp, and a SuperNode that runs whatever app it is sent. Each ``Patch``
below says which Flower module it changes and how, which of our processes install it (only those:
``tests/unit/test_flower_patches.py`` finds every install call and compares), what happens when
the installed Flower no longer reads as the patch expects, the upstream change it stands in for,
and where the measurements that justify it are.

The guard. Each patch checks the Flower module it changes, as it is installed, before changing
it (its ``check_flower``): the shape it relies on must still be there (the module-level ``time``
with its two waits, the pulls' keyword defaults, the executor's one ``Popen``, the SuperNode's
pull-and-store function). That is a stronger guard than a version number, which would refuse a
patch release that changed nothing and pass one that moved a wait. ``TESTED_WITH`` is the Flower
these were written and measured against (constraints.txt pins it; a test checks both agree); a
speed patch on another Flower whose guard still passes applies and says so in the log, one whose
guard fails leaves Flower as it is, with a warning. The gate fails closed: a SuperNode whose
Flower it cannot gate does not start.

Upstream. None of these has an upstream issue or pull request yet (flwrlabs/flower's issues and
pull requests searched on 2026-11-27 for configurable SuperNode waits, pull backoff, a warm
ClientApp start and app pinning found none). ``upstream`` holds the change each stands in for,
as it would be proposed; when Flower ships one, the patch goes and its row with it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("fedvlm.deploy")

TESTED_WITH = "1.42"  # the Flower minor release every patch below was written and measured against


@dataclass(frozen=True)
class Patch:
    name: str
    module: str  # the project module that holds it
    flower: str  # the Flower module it changes
    changes: str
    installed_by: tuple[str, ...]  # the project modules whose processes install it
    on_mismatch: str  # what a Flower its guard does not recognise gets
    upstream: str  # the Flower change it stands in for
    measured: str  # where its figures are
    installers: tuple[str, ...] = ("install",)  # the module's functions whose calls make the change

    def guard(self) -> str | None:
        """Why the installed Flower is not the one this patch changes (None: it is)."""
        check: Callable[..., str | None] = importlib.import_module(self.module).check_flower
        if inspect.unwrap(check).__code__.co_argcount == 0:  # unwrapped: a guard may keep its answer (functools.cache)
            return check()
        return check(importlib.import_module(self.flower))


PATCHES: tuple[Patch, ...] = (
    Patch(
        "supernode-waits",
        "fedvlm.deploy.supernode_polling",
        "flwr.supernode.start_client_internal",
        "the SuperNode loop's `time` becomes a stand-in whose sleep(3) (no message) and sleep(0.5) (a reply not "
        "ready) sleep --idle-poll and --reply-poll seconds, the latter ended early when InMemoryNodeState."
        "store_message stores a reply; its _push_messages gives a reply up after --reply-timeout",
        ("fedvlm/deploy/supernode_polling.py",),
        "runs unchanged, with a warning",
        "flower-supernode options for its two waits (today 3 s and 0.5 s, hard-coded), a reply wait woken by the "
        "reply's store, and a bound on the wait for a ClientApp's reply (today none)",
        "docs/results/deployment.md, 'Deployment speed: a warm node worker'",
    ),
    Patch(
        "clientapp-forks",
        "fedvlm.deploy.clientapp_forks",
        "flwr.supercore.superexec.executor.subprocess_executor",
        "the SuperExec's `subprocess` becomes a stand-in whose Popen of the ClientApp command forks a warm fork "
        "server instead of starting Python and importing Flower again",
        ("fedvlm/deploy/pinned_app.py",),
        "runs unchanged, with a warning (every ClientApp a new process)",
        "a SuperExec executor that starts ClientApps from a warm process (fork server or long-running ClientApp)",
        "docs/results/deployment.md, 'Deployment speed: a warm node worker'",
    ),
    Patch(
        "supernode-gate",
        "fedvlm.deploy.supernode_gate",
        "flwr.supernode.start_client_internal",
        "the SuperNode's _pull_and_store_message refuses a message of an app whose FAB is not pinned, or of "
        "another task type than a ClientApp, before anything of it is stored",
        ("fedvlm/deploy/supernode_polling.py",),
        "refuses to start the SuperNode (GateUnavailable): a node must never run an app it did not pin",
        "app pinning in the SuperNode: a node option listing the FAB hashes it runs",
        "docs/deployment.md, '4. Start a SuperNode'",
    ),
    Patch(
        "long-pulls",
        "fedvlm.deploy.long_pulls",
        "flwr.superlink.routers.fleet.router",
        "the Fleet route /pull-messages (a SuperNode's look for work) and the Runtime route /pull-messages (a "
        "deployed ServerApp's look for replies) become coroutines that call Flower's handler again each time an "
        "instruction, or a reply, is stored (InMemoryLinkState and SqlLinkState.store_message_and_object_tree wake "
        "them) and answer when it has a message or after --pull-hold seconds",
        ("fedvlm/deploy/superlink.py",),
        "runs unchanged, with a warning (every pull answered at once)",
        "a SuperLink that holds an empty pull (long polling) until work for the node, or a reply, arrives or a "
        "bound passes",
        "docs/results/deployment.md, 'The message path, by CPU seconds per program'",
    ),
    Patch(
        "held-task-looks",
        "fedvlm.deploy.long_pulls",
        "flwr.supercore.routers.runtime.router",
        "the SuperNode's Runtime route /acquire-task (its SuperExec's look for a ClientApp to start) becomes a "
        "coroutine that calls Flower's handler again each time the SuperNode stores a message "
        "(InMemoryNodeState.store_message) and answers when it has a task or after 2 s",
        ("fedvlm/deploy/supernode_polling.py",),
        "runs unchanged, with a warning (every look answered at once)",
        "a SuperNode that holds a SuperExec's empty look for a task until a task arrives or a bound passes",
        "docs/results/deployment.md, 'A message with its objects, and held looks'",
        ("install_tasks",),
    ),
    Patch(
        "object-batches-served",
        "fedvlm.deploy.object_batches",
        "flwr.superlink.routers.fleet.router",
        "the Fleet router (SuperLink) and the Runtime router (SuperLink, SuperNode) gain /pull-objects and "
        "/push-objects, each a list of Flower's own per-object requests answered in order by Flower's own "
        "handlers, and both enter Flower's table of protobuf routes (which its node and task authentication read)",
        ("fedvlm/deploy/superlink.py", "fedvlm/deploy/supernode_polling.py"),
        "runs unchanged, with a warning (SuperNodes fall back to one request per object)",
        "Fleet calls that pull and push a message's objects in one request",
        "docs/results/deployment.md, 'The message path, by CPU seconds per program'",
        ("serve",),
    ),
    Patch(
        "object-batches-sent",
        "fedvlm.deploy.object_batches",
        "flwr.supernode.start_client_internal",
        "the SuperNode's http_request_response, pull_objects and push_object_contents_from_iterable send a "
        "message's objects as batches (pull-objects, push-objects), falling back to Flower's one request per "
        "object on a SuperLink without them",
        ("fedvlm/deploy/supernode_polling.py",),
        "runs unchanged, with a warning (one request per object)",
        "Fleet calls that pull and push a message's objects in one request",
        "docs/results/deployment.md, 'The message path, by CPU seconds per program'",
    ),
    Patch(
        "object-batches-runtime",
        "fedvlm.deploy.object_batches",
        "flwr.superlink.grid.http_grid",
        "the ServerApp's grid and the ClientApp's runtime (flwr.supernode.runtime.run_clientapp) pull and push a "
        "message's objects through the Runtime API's batched calls, falling back to one request per object",
        ("fedvlm/deploy/pinned_app.py", "fedvlm/server_app/app.py"),
        "runs unchanged, with a warning (one request per object)",
        "Runtime API calls that pull and push a message's objects in one request",
        "docs/results/deployment.md, 'The message path, by CPU seconds per program'",
        ("install_clients",),
    ),
    Patch(
        "task-input",
        "fedvlm.deploy.task_input",
        "flwr.supernode.runtime.run_clientapp",
        "the SuperNode's Runtime router gains /pull-task (Flower's pull-task-input answer, its FAB's content left "
        "out when the SHA-256 of that content is one the ClientApp names as installed, then Flower's pull-messages "
        "answer and the message's pull-object answers), and a ClientApp pulls its task there, naming the pinned "
        "FABs installed on its node, and hands the parts to Flower's next calls",
        ("fedvlm/deploy/supernode_polling.py", "fedvlm/deploy/pinned_app.py"),
        "runs unchanged, with a warning (three calls per ClientApp, each receiving the whole FAB)",
        "one Runtime call for a ClientApp's task, message and objects, and a task input that leaves out a FAB the "
        "ClientApp process holds already",
        "docs/results/deployment.md, 'A ClientApp's task in one call, without the FAB'",
        ("serve", "Puller"),
    ),
    Patch(
        "whole-messages-served",
        "fedvlm.deploy.whole_messages",
        "flwr.superlink.routers.fleet.router",
        "the Fleet router gains /pull-message (Flower's pull-messages answer, held, with its objects' pull-object "
        "answers) and /push-message (Flower's push-messages answer with the push-object answers of the objects it "
        "asked for), each also carrying the node's confirm-message-received requests, every part answered by "
        "Flower's own handler, both in Flower's table of protobuf routes",
        ("fedvlm/deploy/superlink.py",),
        "runs unchanged, with a warning (SuperNodes fall back to Flower's calls)",
        "Fleet calls that move a message with its objects, and confirmations with the next call",
        "docs/results/deployment.md, 'A message with its objects, and held looks'",
        ("serve",),
    ),
    Patch(
        "whole-messages-sent",
        "fedvlm.deploy.whole_messages",
        "flwr.supernode.start_client_internal",
        "the SuperNode's connection (object-batches-sent's) receives a message with its objects, sends a reply with "
        "its objects and sends each confirmation with its next call (pull-message, push-message), falling back to "
        "Flower's calls on a SuperLink without them",
        ("fedvlm/deploy/supernode_polling.py",),
        "runs unchanged, with a warning (Flower's calls)",
        "Fleet calls that move a message with its objects, and confirmations with the next call",
        "docs/results/deployment.md, 'A message with its objects, and held looks'",
    ),
    Patch(
        "link-lookups",
        "fedvlm.deploy.link_lookups",
        "flwr.server.superlink.linkstate.sql_linkstate",
        "SqlLinkState.get_node_id_by_public_key keeps found nodes per database and key, forgotten by every "
        "create_node and delete_node; SqlCoreState._cleanup_expired_task_tokens sweeps at most once a second",
        ("fedvlm/deploy/superlink.py",),
        "runs unchanged, with a warning (both paid on every request)",
        "node authentication that does not query the node table on every request, and a token sweep on an "
        "interval rather than on every token check",
        "docs/results/deployment.md, 'The message path, by CPU seconds per program'",
    ),
    Patch(
        "object-rows",
        "fedvlm.deploy.object_rows",
        "flwr.supercore.object_store.sql_object_store",
        "SqlObjectStore.preregister, get_object_tree and delete work on a message's objects as sets: one read of "
        "the objects a tree names and four writes, one recursive read of a tree, one read of a subtree's counts "
        "and links then two writes, instead of a few statements per object",
        ("fedvlm/deploy/superlink.py",),
        "runs unchanged, with a warning (a few SQL statements per object of every message)",
        "a SQL object store that registers, reads and deletes a message's object tree in set statements",
        "docs/results/deployment.md, 'A message's objects in set statements'",
    ),
    Patch(
        "object-uploads",
        "fedvlm.deploy.object_uploads",
        "flwr.supercore.corestate.sql_corestate",
        "SqlCoreState gains store_objects: store_object for a request's objects of one push session in one "
        "transaction (one claim of their pending rows, one write of their contents, one count-down), which the "
        "batched Fleet and Runtime routes use for the items their handler stores one after another",
        ("fedvlm/deploy/superlink.py",),
        "runs unchanged, with a warning (a transaction of a few SQL statements per uploaded object)",
        "a core state that stores a batch of one push session's objects in one transaction",
        "docs/results/deployment.md, 'A request's uploaded objects in one transaction'",
    ),
    Patch(
        "scoped-middlewares",
        "fedvlm.deploy.scoped_middlewares",
        "flwr.superlink.main",
        "_get_middleware's six middlewares that act on one API (the Control API's four, the Fleet API's node "
        "authentication and event log) each sit behind a pure-ASGI gate that hands a request it does not act on "
        "to the next layer without entering it",
        ("fedvlm/deploy/superlink.py",),
        "runs unchanged, with a warning (every request enters all eight layers)",
        "a SuperLink app whose API-specific middlewares are mounted on their API's router (or written as pure "
        "ASGI), so that a Fleet call does not pass the Control API's layers",
        "docs/results/deployment.md, 'The SuperLink's middlewares, entered where they act'",
    ),
    Patch(
        "task-claims",
        "fedvlm.deploy.task_claims",
        "flwr.supercore.corestate",
        "InMemoryCoreState.claim_task and SqlCoreState.claim_task give a claimed task --task-start-window seconds "
        "to start (Flower: the 30 s of a heartbeat) and finish a task claimed --task-starts times that never began "
        "FAILED, with the reason",
        ("fedvlm/deploy/superlink.py",),
        "runs unchanged, with a warning (30 s to start, started again without bound)",
        "a SuperLink option for the window a claimed task has to start, and a bound on its starts with the reason "
        "recorded in the run's status",
        "issue 63 item 7: six ServerApps refused in three minutes at load 35, the run never began",
    ),
    Patch(
        "task-reaping",
        "fedvlm.deploy.task_reaping",
        "flwr.supercore.superexec.executor.subprocess_executor",
        "SubprocessExecutor.reconcile, called on every pass of the SuperExec's task loop, also reaps the finished "
        "tasks whose Popen handles the executor dropped (the standard library's subprocess._cleanup)",
        ("fedvlm/deploy/pinned_app.py", "fedvlm/deploy/task_reaping.py"),
        "runs unchanged, with a warning (a finished task stays a zombie until the next start)",
        "a subprocess executor that keeps its tasks' handles and polls them in reconcile",
        "issue 63 item 11: a zombie flwr-serverapp in the SuperLink's container 20 to 60 s after a run",
    ),
    Patch(
        "simulation-polls",
        "fedvlm.deploy.simulation_polls",
        "flwr.server.superlink.linkstate.in_memory_linkstate",
        "InMemoryLinkState.get_message_ins answers [] at once for a node that no stored, undelivered message is "
        "addressed to, instead of fully checking every stored message first; a node with one gets Flower's ask",
        ("fedvlm/server_app/app.py",),
        "runs unchanged, with a warning (a round at 1,000 simulated nodes waits on the engine's polls)",
        "a simulation engine that asks the LinkState once per poll for every node's messages, or an index of "
        "undelivered messages by destination",
        "docs/results/speed.md, 'Scale'",
    ),
    Patch(
        "superlink-accounts",
        "fedvlm.deploy.superlink",
        "flwr.superlink.cli.flower_superlink",
        "the SuperLink command's module-level uvicorn becomes GuardedUvicorn: every connection of an account not "
        "allowed is answered 403 before its request is parsed, forwarding headers are not believed, and the "
        "SuperExec with the secret starts first",
        ("fedvlm/deploy/superlink.py",),
        "refuses to start the SuperLink: every local account could use it",
        "authentication of Control API and runtime users in the open-source SuperLink",
        "docs/deployment.md, '2. Start the SuperLink and its Fleet gateway'",
        ("main",),
    ),
    Patch(
        "instruction-signing",
        "fedvlm.deploy.instruction_signing",
        "flwr.superlink.grid",
        "the ServerApp's grid's push_messages (which send_and_receive and every sender use) signs each message "
        "with the server's key and a fresh nonce first",
        ("fedvlm/server_app/app.py",),
        "the test of the guard fails (a ServerApp whose grid sent another way would send unsigned messages, "
        "which signed nodes refuse)",
        "signed instructions: a ServerApp key that SuperNodes pin",
        "docs/deployment.md, '4. Start a SuperNode'",
        ("sign_pushes",),
    ),
    Patch(
        "pinned-exec",
        "fedvlm.deploy.pinned_app",
        "flwr.supernode.runtime.run_clientapp",
        "the ClientApp runtime's pull_task_input keeps the message and its install_from_fab checks the FAB's pin "
        "and the message's signature before unpacking; the node's SuperExec starts fedvlm-clientapp for "
        "ClientApp tasks and takes no other task type",
        ("fedvlm/deploy/pinned_app.py",),
        "refuses to run any app (the pin fails closed)",
        "app pinning and signed instructions in the SuperNode's runtime",
        "docs/deployment.md, '4. Start a SuperNode'",
        ("clientapp_main", "_exec"),
    ),
    Patch(
        "inprocess-identity",
        "fedvlm.utils.inprocess",
        "flwr.supercore.task_identity",
        "TaskIdentity's run, node and task ids, which Flower's runtime sets, are set for a federation run in one "
        "process without a runtime (tests and benchmarks; never a run)",
        ("fedvlm/utils/inprocess.py",),
        "the test of the guard fails (Flower stamps new messages from elsewhere)",
        "none: Flower's runtime sets them where it runs",
        "-",
        ("ensure_task_identity",),
    ),
)
BY_NAME = {p.name: p for p in PATCHES}


def note_version(patch: str) -> None:
    """Log that ``patch`` applies to a Flower other than the one it was tested with (its guard passed)."""
    import flwr

    if not flwr.__version__.startswith(TESTED_WITH + "."):
        log.warning(
            "fedvlm's %s patch was written for Flower %s; the installed %s still reads as it expects, so it applies",
            patch,
            TESTED_WITH,
            flwr.__version__,
        )


def lacking(owner: object, *names: str) -> str | None:
    """A guard's first question: which of ``names`` ``owner`` (a Flower module or class) does not
    have as a callable, said as "<owner> has no <names>" (None: it has them all)."""
    missing = [n for n in names if not callable(getattr(owner, n, None))]
    return f"{getattr(owner, '__name__', owner)} has no {', '.join(missing)}" if missing else None


def applies(name: str) -> bool:
    """Whether patch ``name`` may change the installed Flower: its guard passes (otherwise a warning
    says why and what the process gets instead, the patch's ``on_mismatch``); a Flower other than
    the one it was tested with is noted (``note_version``)."""
    patch = BY_NAME[name]
    problem = patch.guard()
    if problem is not None:
        log.warning("fedvlm's %s patch leaves Flower as it is (%s): %s", name, problem, patch.on_mismatch)
        return False
    note_version(name)
    return True
