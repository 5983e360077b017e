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

    from fedvlm.deploy import long_pulls, object_batches

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
        object_batches.STORED.clear()


def test_a_store_wakes_only_the_looks_waiting_for_what_it_stored_after_it_returned():
    """A reply wakes the ServerApp's look, any message a SuperExec's; an instruction wakes the nodes'
    pulls at once when its objects are all stored, and only later (the ServerApp's push of them
    wakes them sooner) when some are still to come."""
    from fedvlm.deploy.long_pulls import OBJECTS_LATE_S, _notifying

    stored: list = []
    cases = {
        "replies": [(2, 0.0), (3, 0.0)],
        "fleet-pull": [(1, 0.0), (4, OBJECTS_LATE_S)],
        "tasks": [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0)],
    }
    for name, expected in cases.items():
        stored.clear()
        waker, woken = Waker(), []
        waker.notify = lambda after=0.0, woken=woken: woken.append((len(stored), after))  # type: ignore[method-assign]

        def store(_self, message, *_, **__):
            stored.append(message)
            return True, list(message.missing)

        wrapped = _notifying(store, waker, LOOKS[name].wakes)
        instruction, reply, late = (
            SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=r), missing=m)
            for r, m in (("", ()), ("m", ()), ("", ("an-array",)))
        )
        wrapped(None, instruction, None, "s")
        wrapped(None, reply, None, "s")
        wrapped(None, message=reply, object_tree=None, session_id="s")  # Flower may name them
        wrapped(None, late, None, "s")
        assert woken == expected, name  # counted after each store: a woken look finds it committed


def test_the_servers_push_of_an_instructions_objects_wakes_the_nodes_pulls():
    """The ServerApp's Runtime push-objects calls ``object_batches.STORED`` once its items are
    stored, which the SuperLink's long pulls hook their waker to."""
    from flwr.proto.message_pb2 import PushObjectRequest, PushObjectResponse
    from flwr.proto.node_pb2 import Node

    from fedvlm.deploy import object_batches

    calls: list[str] = []
    handlers = SimpleNamespace(
        push_object=lambda item, state, task: calls.append(item.object_id) or PushObjectResponse(stored=True)
    )
    endpoint = object_batches._runtime_endpoints()[object_batches.PUSH][0]
    request = object_batches.requests()[1](
        node=Node(node_id=7), items=[PushObjectRequest(node=Node(node_id=7), object_id=i) for i in "ab"]
    )
    object_batches.STORED.append(lambda: calls.append("woken"))
    try:
        task = SimpleNamespace(run_id=3)  # the authenticated task: its run is the one the items are stored under
        assert [a.stored for a in endpoint(request, None, handlers, task)] == [True, True]
    finally:
        object_batches.STORED.clear()
    assert calls == ["a", "b", "woken"]  # after the store
