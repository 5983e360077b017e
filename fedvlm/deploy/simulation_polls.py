"""The simulation engine's look for work, without the full check of every message for every node.

Flower 1.42's simulation engine hands messages to its workers from one thread
(``add_messages_to_queue`` in ``flwr/server/superlink/fleet/vce/vce_api.py``): every 0.1 s it asks
the in-memory LinkState for the next message of each of the N simulated nodes, and each ask
(``InMemoryLinkState.get_message_ins``) walks every stored message and fully checks it
(``_check_stored_messages``: the clock, the run's federation, a membership test of both ends)
before it even compares the destination. That is N x M full checks every 0.1 s for M messages in
flight, under the state's lock and the interpreter's lock, whether or not any node has work: at
1,000 nodes it is what a round waited on (docs/results/speed.md, 'Scale').

``install`` puts a look in front of that ask: how many stored, undelivered messages are addressed
to each node, kept on the LinkState, made again only when the stored messages change (their ids,
compared as a tuple) and counted down as the ask delivers; a node no message waits for gets ``[]``
at once, a node some message waits for gets Flower's own ask, unchanged, which checks, delivers
and marks the message as before. The set can be kept because, in Flower's in-memory LinkState, a stored message's
destination never changes and only that ask marks one delivered (``check_flower`` reads both from
the module). Nothing a node receives changes, nor when: the messages, their order and their checks
are Flower's. The one difference is housekeeping: a message is checked for expiry when its own
node is polled, not whenever any node is (its node is polled every 0.1 s, and the ServerApp's pull
of replies runs the same check).

Measured with Flower's own in-memory LinkState, its node registration and grid (``python
bench/simulation_polls.py``), one sweep of the engine over every node, ten messages in flight:
see docs/results/speed.md, 'Scale'.

Installed by the ServerApp of a simulation (``server_app.app``), which shares its process, and its
LinkState, with the engine; the patch is on the class, so it holds for every ask after it,
whichever thread started first. A Flower whose LinkState no longer reads as described runs
unchanged, with a warning (``check_flower``), and ``tests/unit/test_simulation_polls.py`` fails,
which is the signal to revisit this module.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections import Counter
from typing import Any

from fedvlm.deploy import flower_patches

log = logging.getLogger("fedvlm.deploy")

LINKSTATE = "flwr.server.superlink.linkstate.in_memory_linkstate"
# what Flower's ask must still read, for the look in front of it to say the same as the ask would
ASK_READS = ("message_ins_store", "_check_stored_messages", "dst_node_id", "delivered_at")
# where Flower's in-memory LinkState marks a message delivered: an instruction (in the ask) and a reply
MARKS_DELIVERED = re.compile(r"(\w+)\.metadata\.delivered_at\s*=(?!=)")
WAITING = "_fedvlm_waiting"  # on the LinkState: (the stored messages' ids, undelivered messages per node)


def _waiting(state: Any) -> tuple[tuple[str, ...], Counter[int]]:
    """The look (call under the state's lock): the stored messages' ids it was made from, and how
    many stored, undelivered messages are addressed to each node that has one. It can be too wide,
    never too narrow: a node joins it only through a new stored message, which changes the ids and
    makes it again; a delivery takes one out (``_delivered``); a node kept in by mistake gets
    Flower's ask, which says "none" as it would have. Two things it takes from how the engine
    uses the LinkState (a review found no other caller in a simulation): an id is never stored
    again once deleted (the grid names every message with a fresh uuid4), and the one asker, the
    engine's extractor thread, asks without a ``run_id``, so an ask delivers the oldest message
    the look counted."""
    ids = tuple(state.message_ins_store)
    kept = state.__dict__.get(WAITING)
    if kept is None or kept[0] != ids:
        waiting = Counter(
            m.metadata.dst_node_id for m in state.message_ins_store.values() if m.metadata.delivered_at == ""
        )
        kept = state.__dict__[WAITING] = (ids, waiting)
    return kept


def _delivered(state: Any, look: tuple, node_id: int, count: int) -> None:
    """Flower's ask, made after ``look``, handed ``count`` messages to ``node_id``: that many fewer
    wait for it. Only the look the ask was made after counted them; if another has replaced it
    meanwhile (another thread's), the next ask makes one again from the store. (An expired message
    the ask dropped changed the ids: the next look is made again too.)"""
    with state.lock:
        if state.__dict__.get(WAITING) is not look:
            state.__dict__.pop(WAITING, None)
        elif count:
            look[1][node_id] -= count
            if look[1][node_id] <= 0:
                del look[1][node_id]


def check_flower(module: Any = None) -> str | None:
    """Why the installed Flower's in-memory LinkState is not the one this module was written
    against, or None: ``get_message_ins(self, node_id, limit, *, run_id)`` that walks
    ``message_ins_store`` under ``lock`` and picks undelivered messages by ``dst_node_id``."""
    try:
        module = module or importlib.import_module(LINKSTATE)
        ask = getattr(module.InMemoryLinkState.get_message_ins, "flower_ask", module.InMemoryLinkState.get_message_ins)
        params = inspect.signature(ask).parameters
        if list(params)[:3] != ["self", "node_id", "limit"] or "run_id" not in params:
            return f"its get_message_ins takes {list(params)}"
        source = inspect.getsource(ask)
        missing = [name for name in ASK_READS if name not in source]
        if missing:
            return f"its get_message_ins no longer reads {', '.join(missing)}"
        if "self.lock" not in inspect.getsource(module.InMemoryLinkState.__init__):
            return "its InMemoryLinkState has no lock"
        marks = MARKS_DELIVERED.findall(inspect.getsource(module))
        if marks != ["msg_ins", "message_res"] or MARKS_DELIVERED.findall(source) != ["msg_ins"]:
            return f"it marks messages delivered elsewhere than in get_message_ins ({marks})"
    except (ImportError, AttributeError, OSError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def install() -> bool:
    """Make every ask for a node's next message in this process look first, and return ``[]``
    without Flower's full check of every stored message when none waits for that node (the
    module docstring says why the look agrees with the ask). Returns
    whether it took effect (False, with a warning, for a Flower this module does not know);
    installing twice is installing once."""
    module = importlib.import_module(LINKSTATE)
    cls = module.InMemoryLinkState
    if hasattr(cls.get_message_ins, "flower_ask"):
        return True
    why = check_flower(module)
    if why is not None:
        log.warning("Flower's in-memory LinkState is not the one fedvlm knows (%s): leaving it as it is", why)
        return False
    flower_patches.note_version("simulation-polls")
    ask = cls.get_message_ins

    def get_message_ins(self, node_id: int, limit: int | None, *, run_id: int | None = None) -> list:
        if limit is not None and limit < 1:  # Flower's own ask refuses it
            return ask(self, node_id, limit, run_id=run_id)
        with self.lock:
            look = _waiting(self)
            if node_id not in look[1]:
                return []
        try:
            handed = ask(self, node_id, limit, run_id=run_id)
        except BaseException:
            self.__dict__.pop(WAITING, None)  # what the ask did before it failed is unknown: look again
            raise
        _delivered(self, look, node_id, len(handed))
        return handed

    get_message_ins.flower_ask = ask  # type: ignore[attr-defined]
    get_message_ins.__doc__ = ask.__doc__
    cls.get_message_ins = get_message_ins
    return True
