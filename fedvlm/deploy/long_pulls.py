"""Looks for work that the server holds until there is work or ``hold`` seconds pass.

Flower 1.42 answers a look for work at once, empty when nothing waits, and the caller asks again
after a fixed wait. Three such looks sit on the path of every exchange of a deployed round:

- ``fleet-pull``: a SuperNode's ``pull-messages`` on the SuperLink (the SuperNode asks again after
  its idle wait; Flower: 3 s, ``deploy.supernode_polling``: 0.5 s). In a warm 4-node deployment
  14 of a node's 38 Fleet calls a round were such pulls, most of them empty
  (``bench/deployment_speed.py``'s CPU profile; docs/results/deployment.md).
- ``replies``: a deployed ServerApp's Runtime API ``pull-messages`` on the SuperLink, its look
  for replies (``server_app.exchange`` looks every 0.2 s; Flower's grid every 3 s).
- ``tasks``: a SuperExec's ``acquire-task`` on its SuperNode, its look for a ClientApp to start
  (every ``--task-poll`` seconds, 0.2 s here; Flower: 1 s).

Each costs a request whether or not there is anything, and each adds up to one wait to every
exchange: a secure round has five exchanges. Here the server holds an empty look: it calls
Flower's handler again each time what the look waits for is stored (``Look.stores`` on Flower's
states: an instruction, a reply, a message for a ClientApp) and answers as soon as the handler
finds something, or empty after ``hold`` seconds. A look for work reaches it when it is stored,
not up to one wait later, and an idle caller asks ``hold`` times less often.

Nothing a look returns changes: it is Flower's own handler, called as before, once per wake; the
caller's authentication and the gateway's checks are made once per request as before. A held look
holds no worker thread (it waits on the server's event loop) and no database session; the wake
comes after the store returned, so what it stored is committed. Stopping a server waits for a held
look at most ``hold`` seconds.

The guard (``check_flower``) finds each route with the sync endpoint and the
parameters this wraps, and the storing method on every state; a Flower that reads otherwise
answers at once, as before, with a warning (speed lost, nothing else).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedvlm.deploy import flower_patches

log = logging.getLogger("fedvlm.deploy")

HOLD_S = 5.0  # how long an empty pull is held (a stopping SuperLink waits for one at most this)
TASK_HOLD_S = 2.0  # a SuperExec's look for a task: it reconciles its ClientApps between looks
ROUTE = "/pull-messages"


class Waker:
    """Wakes every held pull when an instruction is stored; callable from any thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stored = 0  # instructions stored since the start: a pull waits for this to move
        self._event: asyncio.Event | None = None

    def bind(self) -> asyncio.Event:
        """The event of this process's event loop (the SuperLink's), made on first use."""
        if self._event is None:
            self.loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        return self._event

    def _wake(self) -> None:
        self.stored += 1
        if self._event is not None:
            self._event.set()
            self._event = asyncio.Event()

    def notify(self, after: float = 0.0) -> None:
        """Wake the held pulls, at once or ``after`` seconds (from any thread)."""
        if self.loop is None:
            return
        if after > 0:
            self.loop.call_soon_threadsafe(self.loop.call_later, after, self._wake)
        else:
            self.loop.call_soon_threadsafe(self._wake)

    async def wait(self, seen: int, timeout: float) -> None:
        """Until an instruction is stored after ``seen`` was read, or ``timeout`` seconds."""
        event = self.bind()
        if self.stored != seen or timeout <= 0:
            return
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass


class Hold:
    """Calls a pull again each time an instruction is stored, until it finds something or ``seconds``
    pass; ``run_sync`` runs the sync pull off the event loop (Starlette's threadpool)."""

    def __init__(self, waker: Waker, seconds: float, run_sync: Callable):
        self.waker, self.seconds, self.run_sync = waker, seconds, run_sync

    async def __call__(self, pull: Callable[[], Any], found: Callable[[Any], bool]) -> Any:
        self.waker.bind()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        while True:
            seen = self.waker.stored
            response = await self.run_sync(pull)
            left = deadline - loop.time()
            if found(response) or left <= 0:
                return response
            await self.waker.wait(seen, left)


HOLDS: dict[str, Hold] = {}  # this process's, by look (``LOOKS``), once installed


async def answer(pull: Callable[[], Any], found: Callable[[Any], bool]) -> Any:
    """``pull()``'s answer, held as this SuperLink holds ``/pull-messages`` (at once without holds)."""
    if "fleet-pull" not in HOLDS:
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(pull)
    return await HOLDS["fleet-pull"](pull, found)


def held(pull: Callable, hold: Hold, found: Callable[[Any], bool]) -> Callable:
    """Flower's endpoint ``pull`` as a coroutine that answers once ``found`` holds of its answer or
    when ``hold`` ends."""

    @functools.wraps(pull)
    async def endpoint(**kwargs):
        return await hold(functools.partial(pull, **kwargs), found)

    # FastAPI reads the parameters (their annotations resolved: it would look them up in this module)
    endpoint.__signature__ = inspect.signature(pull, eval_str=True)  # type: ignore[attr-defined]
    return endpoint


@dataclass(frozen=True)
class Look:
    """One of Flower's looks for something that a server may hold: the route (``router``'s module,
    ``path``, the handler's parameters), the state method whose calls may bring it (``stores`` on
    each of ``states``, a call that ``wakes`` returns True for), and when an answer has it (``found``)."""

    router: str
    path: str
    params: tuple[str, ...]
    states: tuple[str, ...]
    stores: str
    wakes: Callable[[Any, Any], float | None]  # of the stored message and what storing it returned: wake after (s)
    found: Callable[[Any], bool]


OBJECTS_LATE_S = 0.5  # an instruction whose objects are still to come: its pulls woken then at the latest


def _instruction_stored(message, stored) -> float | None:
    """When a SuperNode's held pull should look for an instruction just stored: at once when its
    objects are all there (nothing missing), else once the ServerApp's push of them is stored
    (``object_batches.STORED`` wakes it), and ``OBJECTS_LATE_S`` later at the latest, for a
    ServerApp that pushes them one by one. A pull woken sooner would find the message without its
    objects and look for them again and again (12% of a 20-node SuperLink's CPU)."""
    if message.metadata.reply_to_message_id:
        return None
    missing = stored[1] if isinstance(stored, tuple) and len(stored) == 2 else None
    return OBJECTS_LATE_S if missing else 0.0


LINK_STATES = (
    "flwr.server.superlink.linkstate.in_memory_linkstate:InMemoryLinkState",
    "flwr.server.superlink.linkstate.sql_linkstate:SqlLinkState",
)
LOOKS = {
    # a SuperNode's look for work on the SuperLink: an instruction stored (with its object tree)
    "fleet-pull": Look(
        "flwr.superlink.routers.fleet.router",
        ROUTE,
        ("request", "state"),
        LINK_STATES,
        "store_message_and_object_tree",
        _instruction_stored,
        lambda answer: len(answer.messages_list) > 0,
    ),
    # a deployed ServerApp's look for replies on the SuperLink: a reply stored
    "replies": Look(
        "flwr.supercore.routers.runtime.router",
        "/pull-messages",
        ("request", "state", "handlers", "task"),
        LINK_STATES,
        "store_message_and_object_tree",
        lambda message, _stored: 0.0 if message.metadata.reply_to_message_id else None,
        lambda answer: len(answer.messages_list) > 0,
    ),
    # a SuperExec's look for a task on its SuperNode: a message stored (after its task was made)
    "tasks": Look(
        "flwr.supercore.routers.runtime.router",
        "/acquire-task",
        ("request", "state", "handlers", "_auth"),
        ("flwr.supernode.nodestate.in_memory_nodestate:InMemoryNodeState",),
        "store_message",
        lambda _message, _stored: 0.0,
        lambda answer: answer.HasField("task"),
    ),
}


def _load(name: str):
    import importlib

    module, _, attr = name.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attr) if attr else found


def _route(look: Look):
    router = _load(look.router).router
    return router, next((r for r in router.routes if getattr(r, "path", None) == router.prefix + look.path), None)


def check_look(name: str) -> str | None:
    """Why the installed Flower's look ``name`` is not the one this holds (None: it is)."""
    look = LOOKS[name]
    try:
        router, route = _route(look)
        states = [_load(s) for s in look.states]
    except (ImportError, AttributeError) as err:
        return f"it does not have {getattr(err, 'name', None) or err}"
    handler = inspect.unwrap(route.endpoint) if route is not None else None  # under ProtobufRoute's wrapper
    if handler is None or inspect.iscoroutinefunction(handler) or list(route.methods) != ["POST"]:
        return f"its router has no sync POST {look.path} handler"
    if tuple(inspect.signature(handler).parameters) != look.params:
        return f"its {look.path} handler takes other parameters than {look.params}"
    return next(filter(None, (flower_patches.lacking(cls, look.stores) for cls in states)), None)


def check_flower(module) -> str | None:
    """The guard of ``long-pulls`` (Fleet router: a SuperNode's pulls for work and a ServerApp's
    for replies) and of ``held-task-looks`` (Runtime router: a SuperExec's looks for a task)."""
    if module.__name__ == LOOKS["tasks"].router:
        return check_look("tasks")
    return check_look("fleet-pull") or check_look("replies")


def _notifying(store: Callable, waker: Waker, wakes: Callable[[Any, Any], float | None]) -> Callable:
    @functools.wraps(store)
    def stored(self, *args, **kwargs):
        found = store(self, *args, **kwargs)
        after = wakes(kwargs["message"] if "message" in kwargs else args[0], found)
        if after is not None:
            waker.notify(after)  # after the store returned: what it stored is committed
        return found

    return stored


def hold_look(name: str, seconds: float) -> Hold:
    """Hold the look ``name`` in this process (before it builds its app)."""
    from starlette.concurrency import run_in_threadpool

    look = LOOKS[name]
    waker = Waker()
    hold = HOLDS[name] = Hold(waker, seconds, run_in_threadpool)
    router, route = _route(look)
    # a route is built around its endpoint when made: the held one replaces it, made the same way
    router.routes.remove(route)
    router.add_api_route(
        look.path, held(inspect.unwrap(route.endpoint), hold, look.found), methods=["POST"], name=route.name
    )
    for cls in map(_load, look.states):
        setattr(cls, look.stores, _notifying(getattr(cls, look.stores), waker, look.wakes))
    return hold


def install(hold: float = HOLD_S) -> bool:
    """Hold a SuperNode's empty pulls and a ServerApp's looks for replies in this process's
    SuperLink (before it builds its app); False, with a warning, when Flower's pulls are not the
    ones this was written for; ``hold`` 0: Flower's."""
    if hold < 0:
        raise ValueError(f"--pull-hold must be 0 (answer at once) or more seconds; got {hold}")
    if hold == 0:
        return False
    if not flower_patches.applies("long-pulls"):
        return False
    from fedvlm.deploy import object_batches

    fleet = hold_look("fleet-pull", hold)
    object_batches.STORED.append(fleet.waker.notify)  # a ServerApp's objects stored: the instruction is whole
    hold_look("replies", hold)
    return True


def install_tasks(hold: float = TASK_HOLD_S) -> bool:
    """Hold a SuperExec's empty looks for a task in this process's SuperNode (before it builds its
    Runtime API); False, with a warning, when Flower's look is not the one this holds."""
    if not flower_patches.applies("held-task-looks"):
        return False
    hold_look("tasks", hold)
    return True
