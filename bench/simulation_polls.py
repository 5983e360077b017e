"""Benchmark: one sweep of Flower's simulation engine over every node, as the federation grows.

Flower 1.42's engine asks its in-memory LinkState for each node's next message every 0.1 s
(``vce_api.add_messages_to_queue``); this times one such sweep on Flower's own LinkState, nodes
registered by the engine's own ``_register_nodes`` and messages pushed through the simulation's
own ``InMemoryGrid``, before and after ``fedvlm.deploy.simulation_polls.install`` (side by side
in one process: Flower's ask first, then the patched one). A sweep longer than 0.1 s means the
engine's thread never sleeps and a message waits a sweep to be handed to a worker.

    python bench/simulation_polls.py                               # 100, 1,000, 10,000 nodes; 10 and 100 messages
    python bench/simulation_polls.py --nodes 1000 --messages 10 --repeats 50

Prints one line per case and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.measure import bench_report

ROOT = Path(__file__).resolve().parents[1]


def engine_state(num_nodes: int, run_id: int = 1):
    """Flower's in-memory LinkState as its simulation engine sets it up (``run_simulation._main_loop``
    and ``vce_api._register_nodes``): one run of the no-op federation, ``num_nodes`` nodes. Returns
    (state, node ids, grid); the grid pushes as the simulation's ServerApp does."""
    from flwr.proto.task_pb2 import Task  # pylint: disable=no-name-in-module
    from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.federation import NoOpFederationManager
    from flwr.superlink.grid import InMemoryGrid

    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = replace(Run.create_empty(run_id), federation_id=NOOP_FEDERATION_ID, primary_task_id=run_id)
    state.run_ids[run_id] = RunRecord(run=run)
    state.task_store[run_id] = Task(task_id=run_id, run_id=run_id)
    nodes = list(_register_nodes(num_nodes, factory))
    # the simulation's ServerApp runs as the SuperLink's node, in the run's task
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = run_id, 1, run_id
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, nodes, grid


def push(grid, nodes: list[int], count: int) -> list[str]:
    """``count`` messages to nodes spread over the federation, as a round's instructions."""
    from flwr.app import Message, RecordDict

    step = max(1, len(nodes) // count)
    return list(
        grid.push_messages(
            [Message(RecordDict(), dst_node_id=nodes[i * step], message_type="train") for i in range(count)]
        )
    )


def sweep(state, nodes: list[int]) -> int:
    """The engine's extractor, once: the next message of every node (vce_api.add_messages_to_queue)."""
    return sum(len(state.get_message_ins(node_id=n, limit=1)) for n in nodes)


def measure(num_nodes: int, messages: int, repeats: int) -> dict:
    state, nodes, grid = engine_state(num_nodes)
    push(grid, nodes, messages)
    start = time.perf_counter()
    delivered = sweep(state, nodes)  # hands out every message
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):  # the messages wait for their replies, delivered: a round's steady state
        start = time.perf_counter()
        sweep(state, nodes)
        times.append(time.perf_counter() - start)
    return {"delivered": delivered, "first_ms": first * 1e3, "sweep_ms": statistics.median(times) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="100,1000,10000")
    p.add_argument("--messages", default="10,100")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="simulation_polls.json")
    args = p.parse_args()
    from fedvlm.deploy import simulation_polls

    cases = [(int(n), int(m)) for n in args.nodes.split(",") for m in args.messages.split(",") if int(m) <= int(n)]
    rows = []
    for label in ("flower", "patched"):
        if label == "patched" and not simulation_polls.install():
            sys.exit("simulation_polls.install() did not take effect on this Flower")
        for n, m in cases:
            r = measure(n, m, args.repeats if n < 10000 else max(3, args.repeats // 5))
            if r["delivered"] != m:
                sys.exit(f"{label}: {r['delivered']} of {m} messages handed out in one sweep at {n} nodes")
            rows.append({"ask": label, "nodes": n, "messages": m, **r})
            print(
                f"{label:8s} {n:6d} nodes {m:4d} messages: sweep {r['sweep_ms']:8.2f} ms "
                f"(first, handing out: {r['first_ms']:.2f} ms)",
                flush=True,
            )
    by = {(r["nodes"], r["messages"]): r for r in rows if r["ask"] == "flower"}
    for r in rows:
        if r["ask"] == "patched":
            f = by[(r["nodes"], r["messages"])]
            print(
                f"{r['nodes']:6d} nodes {r['messages']:4d} messages: Flower's sweep / patched = "
                f"{f['sweep_ms'] / r['sweep_ms']:.1f}x"
            )
    Path(args.out).write_text(json.dumps(bench_report({"rows": rows}), indent=1) + "\n")


if __name__ == "__main__":
    main()
