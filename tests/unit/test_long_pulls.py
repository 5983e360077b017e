"""A SuperNode's empty pull is held by the SuperLink (``deploy.long_pulls``): answered as soon as
an instruction is stored (woken from another thread, as Flower's request threads store them), or
empty after the hold; Flower's own handler answers every look, and only its answer is returned."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from starlette.concurrency import run_in_threadpool

from fedvlm.deploy.long_pulls import Hold, Waker, held


def _pulls(answers: list[list[str]]):
    calls: list[dict] = []

    def pull(request, state):  # Flower's handler's parameters
        calls.append({"request": request, "state": state})
        return SimpleNamespace(messages_list=answers.pop(0) if answers else [])

    return pull, calls


def test_a_held_pull_answers_when_work_is_stored_and_empty_after_the_hold():
    async def scenario():
        waker = Waker()
        pull, calls = _pulls([[], ["msg"]])
        endpoint = held(pull, Hold(waker, 5.0, run_in_threadpool))
        t0 = time.monotonic()
        # an instruction is stored 0.3 s later, by another thread (a request thread of the ServerApp)
        threading.Timer(0.3, waker.notify).start()
        got = await endpoint(request="r", state="s")
        woken = time.monotonic() - t0
        assert got.messages_list == ["msg"] and 0.25 < woken < 2.0, woken
        assert calls == [{"request": "r", "state": "s"}] * 2  # Flower's handler, once per look

        empty, _ = _pulls([])
        t0 = time.monotonic()
        got = await held(empty, Hold(waker, 0.4, run_in_threadpool))(request="r", state="s")
        assert got.messages_list == [] and 0.35 < time.monotonic() - t0 < 2.0

    asyncio.run(scenario())


def test_work_stored_between_a_look_and_the_wait_is_not_missed():
    """The stored count is read before each look: an instruction stored while the handler runs
    ends the wait at once instead of after the hold."""

    async def scenario():
        waker = Waker()
        waker.bind()
        answers: list[list[str]] = [[], ["msg"]]

        def pull(request, state):
            waker._wake()  # stored while this look runs (after its query), as a race would have it
            return SimpleNamespace(messages_list=answers.pop(0))

        t0 = time.monotonic()
        got = await held(pull, Hold(waker, 5.0, run_in_threadpool))(request="r", state="s")
        assert got.messages_list == ["msg"] and time.monotonic() - t0 < 1.0

    asyncio.run(scenario())


def test_the_installed_route_is_flowers_with_the_held_handler():
    """Installed, Flower's Fleet router serves /pull-messages once, built by Flower's own route
    class around the held handler, with the router's dependencies."""
    import inspect

    from flwr.superlink.routers.fleet import router

    from fedvlm.deploy import long_pulls

    before = {r.path for r in router.router.routes}
    saved = list(router.router.routes)
    states = long_pulls._parts()[1]
    stores = [cls.store_message_ins for cls in states]
    try:
        assert long_pulls.install(2.0)
        routes = [r for r in router.router.routes if r.path.endswith("/pull-messages")]
        assert {r.path for r in router.router.routes} == before and len(routes) == 1
        handler = routes[0].endpoint.__wrapped__  # under Flower's ProtobufRoute wrapper
        assert inspect.iscoroutinefunction(handler) and list(inspect.signature(handler).parameters) == [
            "request",
            "state",
        ]
        assert routes[0].dependencies == saved[0].dependencies
    finally:
        router.router.routes[:] = saved
        for cls, store in zip(states, stores, strict=True):
            cls.store_message_ins = store
