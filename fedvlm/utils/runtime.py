"""Whether this process runs a simulated node: Flower's simulation engine (its ClientApp runs in
a Ray actor) or the project's in-process grid (``utils.inprocess``). Anything else (a
``flwr-clientapp`` process started by a SuperNode) is a real node. And whether a ServerApp's
grid is a simulation's (``simulated_grid``), where every node exists from the start.

The question decides where a node's DP randomness may come from (``privacy.mechanisms``): only a
simulated node may default to noise derived from the run seed. Unknown means real, so a mistake
here costs repeatability, never privacy.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator

_IN_PROCESS = contextvars.ContextVar("fedvlm_in_process_node", default=False)


@contextlib.contextmanager
def in_process_node() -> Iterator[None]:
    """Mark the ClientApp calls of an in-process simulation."""
    token = _IN_PROCESS.set(True)
    try:
        yield
    finally:
        _IN_PROCESS.reset(token)


def simulated_grid(grid: object) -> bool:
    """A simulation's grid: Flower's in-memory one, or an in-process grid made with
    ``simulation=True`` (by default it plays a deployment, whose nodes come and go). A deployed
    ServerApp's grid talks to a SuperLink, where nodes may still connect later."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid) or getattr(grid, "simulation", False) is True


def simulated() -> bool:
    if _IN_PROCESS.get():
        return True
    ray = sys.modules.get("ray")  # never imported by a real node's ClientApp process
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None)
    except Exception:  # noqa: BLE001 - any doubt means a real node
        return False
