"""A SuperNode's empty pull is held by the SuperLink (``deploy.long_pulls``): answered as soon as
an instruction is stored (woken from another thread, as Flower's request threads store them), or
empty after the hold; Flower's own handler answers every look, and only its answer is returned."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from starlette.concurrency import run_in_threadpool

from fedvlm.deploy.long_pulls import LOOKS, Hold, Waker, held

FOUND = LOOKS["fleet-pull"].found


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
        endpoint = held(pull, Hold(waker, 5.0, run_in_threadpool), FOUND)
        t0 = time.monotonic()
        # an instruction is stored 0.3 s later, by another thread (a request thread of the ServerApp)
        threading.Timer(0.3, waker.notify).start()
        got = await endpoint(request="r", state="s")
        woken = time.monotonic() - t0
        assert got.messages_list == ["msg"] and 0.25 < woken < 2.0, woken
        assert calls == [{"request": "r", "state": "s"}] * 2  # Flower's handler, once per look

        empty, _ = _pulls([])
        t0 = time.monotonic()
        got = await held(empty, Hold(waker, 0.4, run_in_threadpool), FOUND)(request="r", state="s")
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
        got = await held(pull, Hold(waker, 5.0, run_in_threadpool), FOUND)(request="r", state="s")
        assert got.messages_list == ["msg"] and time.monotonic() - t0 < 1.0

    asyncio.run(scenario())


def test_each_installed_look_is_flowers_route_with_the_held_handler_and_its_store_wakes_it():
    """Installed, each look (a SuperNode's pull for work, a ServerApp's for replies, a SuperExec's
    for a task) is served once, built by Flower's own route class around the held handler with
    Flower's parameters and the router's dependencies, and the state method that stores what it
    waits for wakes it after the store returned, for the messages it waits for only."""
    import inspect

    from fedvlm.deploy import long_pulls

    routers = {look.router: long_pulls._route(look)[0] for look in LOOKS.values()}
    saved = {name: list(router.routes) for name, router in routers.items()}
    states = {(s, look.stores): long_pulls._load(s) for look in LOOKS.values() for s in look.states}
    stores = {key: cls.__dict__.get(key[1]) for key, cls in states.items()}
    try:
        assert long_pulls.install(2.0) and long_pulls.install_tasks()
        for name, look in LOOKS.items():
            router, route = long_pulls._route(look)
            assert sum(r.path == route.path for r in router.routes) == 1, name
            handler = route.endpoint.__wrapped__  # under Flower's ProtobufRoute wrapper
            assert inspect.iscoroutinefunction(handler), name
            assert tuple(inspect.signature(handler).parameters) == look.params, name
            before = next(r for r in saved[look.router] if r.path == route.path)
            assert route.dependencies == before.dependencies, name
            for state in look.states:  # Flower's own method, wrapped
                assert getattr(long_pulls._load(state), look.stores).__wrapped__ is not None, (name, state)
    finally:
        for name, router in routers.items():
            router.routes[:] = saved[name]
        for (_, method), cls in states.items():
            if stores[(_, method)] is None:  # inherited: the wrapper set on the class goes
                delattr(cls, method)
            else:
                setattr(cls, method, stores[(_, method)])
        long_pulls.HOLDS.clear()


def test_a_store_wakes_only_the_looks_waiting_for_what_it_stored_after_it_returned():
    from fedvlm.deploy.long_pulls import _notifying

    stored: list = []
    for name, expected in (("replies", [2, 3]), ("fleet-pull", [1]), ("tasks", [1, 2, 3])):
        stored.clear()
        waker, woken = Waker(), []
        waker.notify = lambda woken=woken: woken.append(len(stored))  # type: ignore[method-assign]
        store = _notifying(lambda _self, message, *_, **__: stored.append(message), waker, LOOKS[name].wakes)
        instruction, reply = (SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=r)) for r in ("", "m"))
        store(None, instruction, None, "s")
        store(None, reply, None, "s")
        store(None, message=reply, object_tree=None, session_id="s")  # Flower may name them
        assert woken == expected, name  # counted after each store: a woken look finds it committed
