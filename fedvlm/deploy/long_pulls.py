"""A SuperNode's pull for work, held by the SuperLink until there is work or ``hold`` seconds pass.

Flower 1.42's SuperLink answers a SuperNode's ``pull-messages`` at once, empty when nothing waits;
the SuperNode asks again after its idle wait (Flower: 3 s; ``deploy.supernode_polling``: 0.5 s).
Every empty pull is a request through the gateway, TLS, the node's signature check and a database
transaction: in a warm 4-node deployment 14 of a node's 38 Fleet calls a round were pulls, most of
them empty (``bench/deployment_speed.py``'s CPU profile; docs/results/deployment.md). Here the
SuperLink holds an empty pull: it looks again each time an instruction is stored for any node
(``store_message_ins`` of Flower's in-memory and SQL state wakes every held pull) and answers as
soon as one is there for this node, or empty after ``hold`` seconds. A node idle for a minute
makes about ``60 / (hold + its idle wait)`` pulls instead of 120, and work reaches it when it is
stored instead of up to one idle wait later.

Nothing a pull returns changes: it is Flower's own handler, called as before, once per wake; the
node's signature and the gateway's checks are made once per request as before. A held pull holds
no worker thread (it waits on the SuperLink's event loop) and no database session. Stopping the
SuperLink waits for a held pull at most ``hold`` seconds.

The guard (``check_flower``) finds Flower's Fleet route ``/pull-messages`` with the endpoint and
parameters this wraps, and ``store_message_ins`` on both states; a Flower that reads otherwise
answers pulls at once, as before, with a warning (speed lost, nothing else).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("fedvlm.deploy")

HOLD_S = 5.0  # how long an empty pull is held (a stopping SuperLink waits for one at most this)
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

    def notify(self) -> None:
        if self.loop is not None:
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


HOLDS: list[Hold] = []  # this SuperLink's, once installed: other pull routes hold through it too


async def answer(pull: Callable[[], Any], found: Callable[[Any], bool]) -> Any:
    """``pull()``'s answer, held as this SuperLink holds ``/pull-messages`` (at once without holds)."""
    if not HOLDS:
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(pull)
    return await HOLDS[0](pull, found)


def held(pull: Callable, hold: Hold) -> Callable:
    """Flower's pull endpoint as a coroutine that answers once it has a message or when ``hold`` ends."""

    @functools.wraps(pull)
    async def endpoint(**kwargs):
        return await hold(functools.partial(pull, **kwargs), lambda response: len(response.messages_list) > 0)

    # FastAPI reads the parameters (their annotations resolved: it would look them up in this module)
    endpoint.__signature__ = inspect.signature(pull, eval_str=True)  # type: ignore[attr-defined]
    return endpoint


def _parts():
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.superlink.routers.fleet import router

    return router.router, (InMemoryLinkState, SqlLinkState)


def _route(router):
    return next((r for r in router.routes if getattr(r, "path", None) == router.prefix + ROUTE), None)


def check_flower() -> str | None:
    """Why the installed Flower's pulls are not the ones this holds (None: they are)."""
    try:
        router, states = _parts()
    except ImportError as err:
        return f"it does not have {err.name}"
    route = _route(router)
    handler = inspect.unwrap(route.endpoint) if route is not None else None  # under ProtobufRoute's wrapper
    if handler is None or inspect.iscoroutinefunction(handler) or list(route.methods) != ["POST"]:
        return f"its Fleet router has no sync POST {ROUTE} handler"
    if list(inspect.signature(handler).parameters) != ["request", "state"]:
        return f"its {ROUTE} handler takes other parameters than (request, state)"
    if any(not callable(getattr(cls, "store_message_ins", None)) for cls in states):
        return "a link state has no store_message_ins"
    return None


def _notifying(store: Callable, waker: Waker) -> Callable:
    @functools.wraps(store)
    def stored(self, message):
        found = store(self, message)
        waker.notify()
        return found

    return stored


def install(hold: float = HOLD_S) -> bool:
    """Hold empty pulls in this process's SuperLink (before it builds its app); False, with a
    warning, when Flower's pulls are not the ones this was written for; ``hold`` 0: Flower's."""
    if hold < 0:
        raise ValueError(f"--pull-hold must be 0 (answer at once) or more seconds; got {hold}")
    if hold == 0:
        return False
    from starlette.concurrency import run_in_threadpool

    from fedvlm.deploy import flower_patches

    if not flower_patches.applies("long-pulls"):
        return False
    router, states = _parts()
    waker = Waker()
    HOLDS[:] = [Hold(waker, hold, run_in_threadpool)]
    route = _route(router)
    # a route is built around its endpoint when made: the held one replaces it, made the same way
    router.routes.remove(route)
    endpoint = held(inspect.unwrap(route.endpoint), HOLDS[0])
    router.add_api_route(ROUTE, endpoint, methods=["POST"], name=route.name)
    for cls in states:
        cls.store_message_ins = _notifying(cls.store_message_ins, waker)
    return True
