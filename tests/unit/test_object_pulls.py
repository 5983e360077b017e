"""Object pulls asked again sooner: the installed Flower is the one the module knows, a pull of an
object that is not there yet asks again after the new waits (the ClientApp's path through
``pull_and_inflate_object_from_tree``, the SuperNode's and the ServerApp's through ``pull_objects``),
the same message arrives, and a Flower the module does not know is left alone."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.inflatable import inflatable_utils as utils
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

from fedvlm.deploy import object_pulls


@pytest.fixture
def flower_defaults():
    """Each pull function as installed Flower has it during the test, as it was after."""
    saved = {}
    for name in object_pulls.PULLS:
        fn = getattr(utils, name)
        saved[fn] = (fn.__kwdefaults__, fn.__dict__.pop("flower_defaults", None))
        fn.__kwdefaults__ = dict(saved[fn][1] or fn.__kwdefaults__)
    yield
    for fn, (defaults, flower) in saved.items():
        fn.__kwdefaults__ = defaults
        fn.__dict__.pop("flower_defaults", None)
        if flower is not None:
            fn.__dict__["flower_defaults"] = flower


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The waits a pull asks for between two tries, without waiting (no jitter)."""
    asked: list[float] = []

    class Event(threading.Event):
        def wait(self, timeout=None):
            asked.append(timeout)
            return self.is_set()

    monkeypatch.setattr(utils, "threading", types.SimpleNamespace(Lock=threading.Lock, Event=Event))
    monkeypatch.setattr(utils, "random", types.SimpleNamespace(uniform=lambda a, b: 0.0))
    return asked


def _store(message: Message, missing: str, times: int):
    """A sender's object store in which ``missing`` is not there the first ``times`` asks."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    asks = {missing: 0}

    def pull(object_id: str) -> bytes:
        if object_id == missing and asks[missing] < times:
            asks[missing] += 1
            raise ObjectUnavailableError(object_id)
        return contents[object_id]

    return pull


def _message() -> Message:
    content = RecordDict(
        {"arrays": ArrayRecord({"ctx": Array(np.arange(12, dtype=np.float32))}), "cfg": ConfigRecord({"lr": 0.1})}
    )
    return Message(content, dst_node_id=7, message_type="train")


def test_installed_flower_is_the_one_the_module_knows():
    # fails on a Flower upgrade that moved or renamed the pulls' waits: revisit object_pulls then
    import flwr.superlink.grid.http_grid  # noqa: F401 - every caller imported, so each is checked
    import flwr.supernode.start_client_internal  # noqa: F401

    assert object_pulls.check_flower() is None


def test_flower_asks_again_after_one_second_and_ours_after_the_first_retry(flower_defaults, waits):
    message = _message()
    array = next(oid for oid, obj in get_all_nested_objects(message).items() if isinstance(obj, Array))
    utils.pull_objects([array], _store(message, array, times=3))
    assert waits == [1, 2, 4]  # Flower's own
    waits.clear()
    assert object_pulls.install(0.1, first=0.05)
    utils.pull_objects([array], _store(message, array, times=3))
    assert waits == [0.05, 0.1, 0.1]


def test_the_clientapps_pull_of_a_whole_message_asks_sooner_and_gets_the_same_message(flower_defaults, waits):
    message = _message()
    tree = get_object_tree(message)
    array = next(oid for oid, obj in get_all_nested_objects(message).items() if isinstance(obj, Array))
    assert object_pulls.install(object_pulls.CLIENTAPP_CAP_S)
    confirmed: list[str] = []
    got = utils.pull_and_inflate_object_from_tree(
        tree, _store(message, array, times=2), confirmed.append, return_type=Message
    )
    assert waits == [object_pulls.FIRST_RETRY_S, 2 * object_pulls.FIRST_RETRY_S]
    assert confirmed == [tree.object_id]
    np.testing.assert_array_equal(got.content["arrays"]["ctx"].numpy(), np.arange(12, dtype=np.float32))
    assert got.content["cfg"]["lr"] == 0.1


def test_it_gives_up_after_as_long_as_flower_would_and_installing_twice_changes_nothing(flower_defaults):
    flower = dict(utils.pull_objects.__kwdefaults__)
    assert object_pulls.install(0.1, first=0.05)
    assert object_pulls.install(0.1, first=0.05)  # a second install starts from Flower's values again
    ours = utils.pull_objects.__kwdefaults__
    assert ours["max_tries_per_object"] * ours["backoff_cap"] >= flower["max_tries_per_object"] * flower["backoff_cap"]
    assert ours["max_time"] == flower["max_time"]
    assert utils.pull_and_inflate_object_from_tree.__kwdefaults__["initial_backoff"] == 0.05


def test_never_later_than_flower(flower_defaults):
    assert object_pulls.install(50.0, first=5.0)
    ours = utils.pull_objects.__kwdefaults__
    assert (ours["initial_backoff"], ours["backoff_cap"]) == (1, 10)


def test_a_flower_it_does_not_know_is_left_alone(flower_defaults, monkeypatch, caplog):
    monkeypatch.setattr(utils.pull_objects, "__kwdefaults__", {"max_time": 7200})
    assert "initial_backoff" in object_pulls.check_flower()
    assert not object_pulls.install(object_pulls.SUPERLINK_CAP_S)
    assert utils.pull_objects.__kwdefaults__ == {"max_time": 7200}
    assert "object-pulls patch leaves Flower as it is (" in caplog.text and "runs unchanged" in caplog.text


@pytest.mark.parametrize("first, cap", [(0, 1), (-1, 1), (0.5, 0.1), (float("nan"), 1)])
def test_waits_that_make_no_sense_are_refused(first, cap):
    with pytest.raises(ValueError, match="first retry"):
        object_pulls.install(cap, first=first)
