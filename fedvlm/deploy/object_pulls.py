"""Flower's object pulls, asked again sooner when an object is not there yet.

A Flower message travels as a tree of objects (the message, its record dict, each record, each
array), and whoever receives it pulls them one by one (``pull_objects`` in
``flwr/supercore/inflatable/inflatable_utils.py``): the SuperNode from the SuperLink, the ClientApp
from its SuperNode, the ServerApp from the SuperLink. An object its sender has not finished storing
is "unavailable", and Flower asks for it again after 1 s, then 2, 4 and 8 s, then every 10 s
(``PULL_INITIAL_BACKOFF`` and ``PULL_BACKOFF_CAP``, which nothing configures).

On a deployment that is the rule, not the exception. Flower 1.42's SuperNode stores a message
(without its content) and creates its task before it pulls the message's objects from the
SuperLink, and puts them in its store only once it has them all; the SuperExec starts the
ClientApp meanwhile, and the ClientApp asks for the objects while they are still on their way:
nearly every ClientApp heard "not yet" and waited Flower's first second (docs/results/deployment.md,
'A message's parts, asked for again sooner'; this patch's row in ``deploy.flower_patches``).

``install`` makes the first wait in this process ``FIRST_RETRY_S`` (0.05 s); it then doubles as
Flower's does, up to a cap, and a pull gives up after as long as Flower's would (the number of
tries grows as the waits shrink). Each process of ours that pulls installs it:

- the ClientApp (``deploy.pinned_app.clientapp_main``), whose objects are on their way to its
  own SuperNode: asked for on loopback, at most every 0.25 s (``CLIENTAPP_CAP_S``);
- the SuperNode (``deploy.supernode_polling``), whose message's objects may still be on their
  way from the server (it sees a message as soon as the server has pushed its first part), and
  a deployed ServerApp (``server_app.app``; a simulation pulls nothing), whose replies' objects
  may still be on their way from a SuperNode: asked for over the network, at most once a second
  (``SUPERLINK_CAP_S``). The
  SuperLink, one process serving every node, hears a few more asks per message than Flower's
  1, 3, 7 s would make (five in the first 1.55 s against one), never a steady stream.

Every extra ask costs some CPU while a pull waits, a lookup that answers "not yet": on one machine
running twenty organisations, ClientApps asking every 0.1 s made rounds longer, every 0.25 s did
not (the same section). On its own machine, each organisation pays its own asks only.

Nothing else changes: what is pulled, the check on it (an object's id is the hash of its
content, checked when it is inflated), the limit on time. Nothing here touches data or privacy:
the same objects arrive, only sooner.

As with the polling shim, a Flower whose pulls no longer read as described runs unchanged, with a
warning (``check_flower``), and ``tests/unit/test_object_pulls.py`` fails, which is the signal to
revisit this module.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
from collections.abc import Callable

from fedvlm.deploy import flower_patches

log = logging.getLogger("fedvlm.deploy")

FIRST_RETRY_S = 0.05
# the longest wait between two asks (see the module docstring)
CLIENTAPP_CAP_S = 0.25
SUPERLINK_CAP_S = 1.0
# where Flower 1.42 pulls: pull_objects, and pull_and_inflate_object_from_tree (the ClientApp's
# pulls), which passes its own defaults on to it; the ServerApp's HTTP grid and the SuperNode's
# loop import pull_objects by name and call it with its defaults
UTILS = "flwr.supercore.inflatable.inflatable_utils"
PULLS = ("pull_objects", "pull_and_inflate_object_from_tree")
CALLERS = ("flwr.superlink.grid.http_grid", "flwr.supernode.start_client_internal")
KNOBS = ("initial_backoff", "backoff_cap", "max_tries_per_object")


def _pulls() -> list[Callable]:
    utils = importlib.import_module(UTILS)
    return [getattr(utils, name) for name in PULLS]


def check_flower() -> str | None:
    """Why the installed Flower is not the one this module was written against, or None: each
    function in ``PULLS`` takes its first wait, longest wait and tries as keywords with defaults,
    and each module in ``CALLERS`` that this process has imported calls that same
    ``pull_objects`` (one imported later binds the same function, defaults and all; the unit test
    imports them all)."""
    try:
        pulls = _pulls()
        for fn in pulls:
            defaults = fn.__kwdefaults__ or {}
            for knob in KNOBS:
                if not isinstance(defaults.get(knob), int | float):
                    return f"its {fn.__name__} has no numeric `{knob}` keyword default"
        for name in CALLERS:
            if name in sys.modules and getattr(sys.modules[name], "pull_objects", None) is not pulls[0]:
                return f"{name} no longer calls {UTILS}.pull_objects"
    except (ImportError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def install(cap: float, first: float = FIRST_RETRY_S) -> bool:
    """Make every object pull in this process ask again after ``first`` seconds, doubling up to
    ``cap``, never later than Flower would; it gives up when Flower's would, after as long (its
    number of tries grows as its waits shrink). Returns whether it took effect (False, with a
    warning, for a Flower this module does not know)."""
    if not 0 < first <= cap:
        raise ValueError(f"object pulls: need 0 < first retry <= longest wait; got {first} and {cap} s")
    if not flower_patches.applies("object-pulls"):
        return False
    for fn in _pulls():
        flower = fn.__dict__.setdefault("flower_defaults", dict(fn.__kwdefaults__ or {}))  # before any install here
        cap_ = min(cap, flower["backoff_cap"])
        fn.__kwdefaults__ = {
            **flower,
            "initial_backoff": min(first, flower["initial_backoff"]),
            "backoff_cap": cap_,
            "max_tries_per_object": math.ceil(flower["max_tries_per_object"] * flower["backoff_cap"] / cap_),
        }
    return True
