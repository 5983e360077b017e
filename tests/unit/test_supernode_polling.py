"""The SuperNode polling shim: it applies to the installed Flower, changes only the two waits it
names, and leaves a Flower it does not know alone."""

from __future__ import annotations

import time
import types

import pytest

from fedvlm.deploy import supernode_polling as polling


def test_installed_flower_is_the_loop_the_shim_knows():
    # fails on a Flower upgrade that moved the SuperNode's waits: revisit supernode_polling then
    import flwr.supernode.start_client_internal as loop

    assert polling.check_flower(loop) is None


def _undone_after(monkeypatch):
    """What ``install`` changes in Flower, put back after the test."""
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    monkeypatch.setattr(loop, "time", time)
    monkeypatch.setattr(loop, "_push_messages", loop._push_messages)
    monkeypatch.setattr(InMemoryNodeState, "store_message", InMemoryNodeState.store_message)
    return loop


def test_install_swaps_only_the_two_waits(monkeypatch):
    loop = _undone_after(monkeypatch)
    assert polling.install(0.05, 0.01)
    clock = loop.time
    assert isinstance(clock, polling.PollingClock)
    slept: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", slept.append)
    clock.sleep(3)
    t0 = time.monotonic()
    clock.sleep(0.5)  # the reply wait: until a reply is stored, or --reply-poll
    assert 0.01 <= time.monotonic() - t0 < 0.4
    clock.sleep(0.2)  # any other wait is Flower's own
    assert slept == [0.05, 0.2]
    assert clock.monotonic is time.monotonic and clock.time is time.time


def _message(reply_to=None):
    from flwr.app import Message, RecordDict

    from fedvlm.utils.inprocess import ensure_task_identity

    ensure_task_identity()
    message = Message(RecordDict(), reply_to=reply_to) if reply_to else Message(RecordDict(), 1, "train")
    message.metadata.__dict__["_message_id"] = message.object_id  # as Flower sets it when it sends one
    return message


def test_a_stored_reply_ends_the_reply_wait_at_once(monkeypatch):
    """The ClientApp's reply, stored in Flower's own node state from another thread (the Runtime
    API's), wakes the node's reply wait: it looks again at once, not --reply-poll later. An
    instruction stored does not wake it."""
    import threading

    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.nodestate import NodeStateFactory

    loop = _undone_after(monkeypatch)
    assert polling.install(0.5, 0.5)
    state = NodeStateFactory(ObjectStoreFactory()).state()
    instruction = _message()
    state.store_message(instruction)
    t0 = time.monotonic()
    loop.time.sleep(0.5)  # an instruction stored before the wait woke nothing
    assert time.monotonic() - t0 >= 0.45
    threading.Timer(0.05, state.store_message, [_message(reply_to=instruction)]).start()
    t0 = time.monotonic()
    loop.time.sleep(0.5)
    assert 0.04 <= time.monotonic() - t0 < 0.3
    assert [m.metadata.reply_to_message_id for m in state.get_messages_legacy(is_reply=True)] == [
        instruction.metadata.message_id
    ]


def test_a_flower_loop_that_changed_runs_unchanged(monkeypatch, caplog):
    source = "import time\n\ndef loop():\n    time.sleep(5)\n    time.sleep(0.5)\n    time.sleep(0.5)\n"
    changed = types.ModuleType("changed_loop")
    exec(compile(source, "<changed>", "exec"), changed.__dict__)
    monkeypatch.setattr(polling.inspect, "getsource", lambda module: source)
    assert "time.sleep(3)" in polling.check_flower(changed)
    waits = "import time\n\ndef loop():\n    time.sleep(3)\n    time.sleep(0.5)\n    time.sleep(0.5)\n"
    exec(compile(waits, "<waits>", "exec"), changed.__dict__)
    monkeypatch.setattr(polling.inspect, "getsource", lambda module: waits)
    assert "has no _push_messages" in polling.check_flower(changed)  # the reply wait it bounds moved
    import flwr.supernode.start_client_internal as loop

    monkeypatch.setattr(loop, "time", time)
    monkeypatch.setattr(polling.inspect, "getsource", lambda module: source)
    assert not polling.install(0.5, 0.1)
    assert loop.time is time
    assert "running it with its own waits" in caplog.text


@pytest.mark.parametrize("idle, reply", [(0, 0.1), (4, 0.1), (0.5, 0), (0.5, 0.6), (float("nan"), 0.1)])
def test_waits_outside_flowers_own_are_refused(idle, reply):
    with pytest.raises(ValueError, match="--idle-poll must be in"):
        polling.PollingClock(idle, reply)


def test_a_node_without_a_privacy_limit_says_so_loudly(caplog):
    with caplog.at_level("WARNING", logger="fedvlm.supernode"):
        limited = ["--superlink", "x:1", "--node-config", "data-dir='/d' max-epsilon=8 delta=1e-5 state-dir='/s'"]
        assert polling.warn_without_limit(limited) and not caplog.records
        assert not polling.warn_without_limit(["--node-config=data-dir='/d' name='org-a'"])
    (record,) = caplog.records
    assert "THIS NODE STATES NO PRIVACY LIMIT" in record.getMessage() and "max-epsilon=<limit>" in record.getMessage()


def test_the_supernode_takes_no_run_without_a_pin(capsys):
    with pytest.raises(SystemExit):
        polling.main(["--", "--superlink", "x:1"])
    assert "--pin" in capsys.readouterr().err


def test_a_reply_that_never_comes_is_given_up_and_the_node_pulls_again(monkeypatch, caplog):
    """A task whose token another local account took, never answered: Flower's own reply wait,
    on Flower's own node state, now ends after --reply-timeout with the loss logged, nothing sent."""
    import flwr.supernode.start_client_internal as loop
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.nodestate import NodeStateFactory

    _undone_after(monkeypatch)
    assert polling.install(0.05, 0.01, reply_timeout=0.3)
    state = NodeStateFactory(ObjectStoreFactory()).state()  # holds no reply, and none will come
    sent: list[object] = []
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="fedvlm.supernode"):
        loop._push_messages(state=state, object_store=None, send=lambda *a: sent.append(a), push_object=None)
    assert 0.3 <= time.monotonic() - t0 < 3 and not sent
    assert "no reply from this node's ClientApp within --reply-timeout (0.3 s)" in caplog.text
    assert loop.time.deadline is None  # the next wait (an idle pull) is not bounded


def test_a_reply_in_time_goes_out_unbounded_by_the_last_one(caplog):
    clock = polling.PollingClock(0.5, 0.01)
    calls: list[float | None] = []
    bounded = polling.bound_replies(lambda **kw: calls.append(clock.deadline), clock, 5.0)
    bounded(state=None)
    assert calls[0] is not None and clock.deadline is None and not caplog.records
    with pytest.raises(ValueError, match="--reply-timeout must be a positive"):
        polling.install(0.5, 0.1, reply_timeout=0)
