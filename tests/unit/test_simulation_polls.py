"""The simulation engine's look for work (``deploy.simulation_polls``): on Flower's own in-memory
LinkState, set up as its engine sets it up, every node gets exactly the messages Flower's ask
gives it, in the same sweep, however messages come and go."""

from __future__ import annotations

import time
import types
from uuid import uuid4

import pytest
from flwr.server.superlink.linkstate import in_memory_linkstate

from bench.simulation_polls import engine_state, push, sweep
from fedvlm.deploy import simulation_polls


@pytest.fixture
def patched(monkeypatch):
    """The patch, installed for one test: Flower's own ask comes back after it."""
    cls = in_memory_linkstate.InMemoryLinkState
    monkeypatch.setattr(cls, "get_message_ins", cls.get_message_ins)
    assert simulation_polls.install()
    assert simulation_polls.install()  # twice is once
    assert cls.get_message_ins.flower_ask.__qualname__ == "InMemoryLinkState.get_message_ins"
    return cls


def _handed_out(state, nodes) -> dict[int, list[str]]:
    """One engine sweep: node -> the ids of the messages it was handed."""
    return {
        n: [m.metadata.message_id for m in got] for n in nodes if (got := state.get_message_ins(node_id=n, limit=1))
    }


def _rounds(state, grid, nodes) -> list[dict[int, list[str]]]:
    """Three sweeps: messages pushed, handed out, more pushed (to nodes served and not), a
    reply that removes a served one, an expired message that is dropped."""
    from flwr.app import Message, RecordDict

    seen = []
    push(grid, nodes, 5)
    seen.append(_handed_out(state, nodes))
    seen.append(_handed_out(state, nodes))  # nothing new: nothing handed out twice
    push(grid, nodes, 7)
    stale = Message(RecordDict(), dst_node_id=nodes[3], message_type="train", ttl=0.001)
    grid.push_messages([stale])
    time.sleep(0.01)
    seen.append(_handed_out(state, nodes))
    return seen


def test_every_node_is_handed_what_flowers_ask_hands_it(patched):
    cls = in_memory_linkstate.InMemoryLinkState
    flower_ask = cls.get_message_ins.flower_ask

    mine, nodes, grid = engine_state(40)
    got = _rounds(mine, grid, nodes)

    cls.get_message_ins = flower_ask  # the same sequence under Flower's ask (monkeypatch restores)
    theirs, nodes_f, grid_f = engine_state(40)
    want = _rounds(theirs, grid_f, nodes_f)

    def shape(sweeps, nodes_):  # message ids differ between the two states: compare who got how many
        index = {n: i for i, n in enumerate(nodes_)}
        return [{index[n]: len(ids) for n, ids in s.items()} for s in sweeps]

    assert shape(got, nodes) == shape(want, nodes_f)
    assert [len(s) for s in got] == [5, 0, 7]  # the expired message is handed to no one
    assert len(mine.message_ins_store) == len(theirs.message_ins_store) == 12


def test_a_message_stored_between_sweeps_is_handed_out_on_the_next(patched):
    state, nodes, grid = engine_state(30)
    assert sweep(state, nodes) == 0
    assert simulation_polls.WAITING in state.__dict__  # the look was kept ...
    (mid,) = push(grid, nodes[7:8], 1)
    assert sweep(state, nodes) == 1  # ... and made again when the stored messages changed
    assert state.message_ins_store[mid].metadata.delivered_at != ""
    assert sweep(state, nodes) == 0


def test_a_replied_message_is_gone_and_its_node_not_served_again(patched):
    from flwr.app import Message, RecordDict

    state, nodes, grid = engine_state(10)
    (mid,) = push(grid, nodes[2:3], 1)
    (ins,) = state.get_message_ins(node_id=nodes[2], limit=1)
    reply = Message(RecordDict(), reply_to=ins)
    reply.metadata.__dict__["_message_id"] = str(uuid4())  # as the engine's worker names a reply
    state.store_message_res(reply)
    replies = grid.pull_messages([mid])
    assert [r.metadata.reply_to_message_id for r in replies] == [mid]
    assert mid not in state.message_ins_store
    assert sweep(state, nodes) == 0


def test_flowers_own_refusals_stand(patched):
    state, nodes, _ = engine_state(3)
    with pytest.raises(AssertionError):
        state.get_message_ins(node_id=nodes[0], limit=0)


def test_another_run_is_filtered_as_flower_filters_it(patched):
    state, nodes, grid = engine_state(5)
    push(grid, nodes[:1], 1)
    assert state.get_message_ins(node_id=nodes[0], limit=1, run_id=99) == []
    assert len(state.get_message_ins(node_id=nodes[0], limit=1, run_id=1)) == 1


def test_a_linkstate_of_another_shape_is_left_alone():
    def get_message_ins(self, node_id, limit, *, run_id=None):  # reads none of what the look relies on
        return []

    other = types.SimpleNamespace(
        InMemoryLinkState=type(
            "InMemoryLinkState", (), {"get_message_ins": get_message_ins, "__init__": lambda s: None}
        )
    )
    assert "no longer reads" in simulation_polls.check_flower(other)
    assert simulation_polls.check_flower() is None


def test_a_node_with_two_messages_gets_one_a_sweep_and_then_none(patched):
    state, nodes, grid = engine_state(8)
    push(grid, [nodes[4]], 1)
    push(grid, [nodes[4]], 1)
    look = state.__dict__
    assert [sweep(state, nodes) for _ in range(3)] == [1, 1, 0]  # limit=1, as the engine asks
    assert nodes[4] not in look[simulation_polls.WAITING][1]  # counted down: no full check for it any more


def test_a_count_down_against_a_look_made_since_makes_the_next_one_afresh(patched):
    state, nodes, grid = engine_state(4)
    push(grid, [nodes[1]], 1)
    with state.lock:
        old = simulation_polls._waiting(state)
    state.__dict__[simulation_polls.WAITING] = (old[0], old[1].copy())  # another thread's look
    simulation_polls._delivered(state, old, nodes[1], 1)
    assert simulation_polls.WAITING not in state.__dict__
    assert sweep(state, nodes) == 1
