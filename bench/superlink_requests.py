"""Benchmark: the SuperLink's CPU per request, by kind, in one process, with SQLite state.

Flower's SuperLink app (``flwr.superlink.main.create_app``) is built with the patches the
deployment's SuperLink installs (``deploy.superlink._install_patches``), node authentication on
and its link state and object store in a SQLite file (``FLWR_DATABASE``, what ``--database FILE``
gives). Requests go through httpx's ASGI transport (no sockets, no TLS: what is measured is the
app and its database), in the order of a PromptFL round of ``--nodes`` nodes: the ServerApp's
instructions and their objects, each node's ``pull-message``, heartbeat and ``push-message``
(its reply, the reply's objects and its confirmation), then the ServerApp's pull of the replies,
their objects and its confirmations. The messages carry what the deployment's do: a 60x512
float32 prompt, a config record and the instruction's signature record; a reply its own prompt,
metrics and config. A request's CPU is the process's CPU time around it (every thread: the event
loop and Starlette's worker threads), so load elsewhere on the machine does not count; each
repeat starts from a fresh database.

    python -m bench.superlink_requests --nodes 20 --rounds 6 --repeats 3 --out superlink_requests.json

``--threads inline-dependencies`` runs FastAPI's synchronous dependencies (Flower's
``get_linkstate``, its version check, the protobuf body parser) on the event loop instead of
handing each to a worker thread, and ``inline`` also the routes and the node-auth check: what a
patch that takes the thread hops away would save, measured before writing one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench.measure import bench_report
from tests.unit.test_object_batches import _signed

PB = {"content-type": "application/protobuf"}
PROMPT = (60, 512)  # PromptFL's context vectors on the embedded CLIP, as the deployment sends them


THREADS = ("flower", "inline-dependencies", "inline")


def _inline_threads(setting: str) -> None:
    """Run what ``setting`` names on the event loop rather than in Starlette's worker threads."""
    if setting == "flower":
        return
    import fastapi.dependencies.utils
    import fastapi.routing
    import flwr.supercore.protobuf.routing
    import flwr.superlink.routers.fleet.node_auth

    async def inline(func, *args, **kwargs):
        return func(*args, **kwargs)

    modules = [fastapi.dependencies.utils]
    if setting == "inline":
        modules += [fastapi.routing, flwr.supercore.protobuf.routing, flwr.superlink.routers.fleet.node_auth]
    for module in modules:
        assert hasattr(module, "run_in_threadpool"), f"{module.__name__} no longer hands work to threads this way"
        setattr(module, "run_in_threadpool", inline)  # noqa: B010 - each module imported the name itself


def _app(database: Path):
    """Flower's SuperLink app on ``database``, patched as the deployed SuperLink is."""
    from flwr.superlink.main import create_app

    from fedvlm.deploy import long_pulls, superlink, task_claims

    superlink.install_patches(task_claims.START_WINDOW_S, task_claims.MAX_STARTS, long_pulls.HOLD_S)

    os.environ["FLWR_DATABASE"] = str(database)
    app = create_app()
    app.state.enable_supernode_auth = True  # as the deployment runs it
    return app


def _federation(app, nodes: int):
    """A run whose ServerApp task is started (its token), and ``nodes`` registered nodes with keys."""
    from flwr.supercore.constant import NOOP_FEDERATION_ID, TaskType
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

    state = app.state.linkstate_factory.state()
    run = state.create_run("someone/app", "1.0.0", "h", {}, NOOP_FEDERATION_ID, None, None, TaskType.SERVER_APP)
    (task,) = state.get_tasks()
    token = state.claim_task(task.task_id)
    assert token and state.activate_task(task.task_id)
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    # the messages this process makes are the ServerApp's of this run and task
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, SUPERLINK_NODE_ID, task.task_id
    keys = [generate_key_pairs() for _ in range(nodes)]
    ids = [state.create_node("acct", f"org-{i}", public_key_to_bytes(k[1]), 30.0) for i, k in enumerate(keys)]
    for node in ids:
        state.activate_node(node, 30.0)
    return run, token, list(zip(ids, keys, strict=True))


def _parts(message):
    """A message as it is pushed: its proto without content, its object tree, its objects' bytes."""
    from flwr.app.message import remove_content_from_message
    from flwr.common.serde import message_to_proto
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

    message.metadata.__dict__["_message_id"] = message.object_id
    objects = {i: o.deflate() for i, o in get_all_nested_objects(message).items()}
    return message_to_proto(remove_content_from_message(message)), get_object_tree(message), objects


def _instruction(node: int, prompt: np.ndarray, server_round: int):
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

    content = RecordDict(
        {
            "arrays": ArrayRecord({"prompt": Array(prompt)}),
            "config": ConfigRecord({"server-round": server_round, "lr": 0.002, "local-steps": 1}),
            "signature": ConfigRecord({"key": "k" * 16, "signature": os.urandom(64).hex()}),
        }
    )
    return Message(content, dst_node_id=node, message_type="train")


def _reply(instruction, rng: np.random.Generator):
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    prompt = rng.standard_normal(PROMPT).astype(np.float32)
    content = RecordDict(
        {
            "arrays": ArrayRecord({"prompt": Array(prompt)}),
            "metrics": MetricRecord({"num-examples": 320, "train-loss": 1.2}),
            "config": ConfigRecord({"seconds": 1.5}),
        }
    )
    return Message(content, reply_to=instruction)


class Caller:
    """Posts protobuf requests to the app and books each one's CPU and SQL statements under its kind."""

    def __init__(self, client, token: str):
        from flwr.supercore.constant import TASK_TOKEN_HEADER
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        self.client, self.runtime = client, {**PB, TASK_TOKEN_HEADER: token}
        self.cpu: dict[str, list[float]] = defaultdict(list)
        self.sql: dict[str, list[int]] = defaultdict(list)
        self.statements = 0
        event.listen(Engine, "before_cursor_execute", self._count)

    def _count(self, *_) -> None:
        self.statements += 1

    def close(self) -> None:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        event.remove(Engine, "before_cursor_execute", self._count)

    async def post(self, path: str, request, headers: dict, answer=None):
        t, n, kind = time.process_time(), self.statements, path.removeprefix("/v1/")
        got = await self.client.post(path, content=request.SerializeToString(), headers=headers)
        self.cpu[kind].append((time.process_time() - t) * 1e3)
        self.sql[kind].append(self.statements - n)
        if got.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {got.status_code} {got.text[:200]}")
        return answer.FromString(got.content) if answer is not None else None


async def _serverapp_sends(call: Caller, run: int, nodes: list, server_round: int, rng) -> list:
    """The ServerApp's instructions to every node (one prompt for all, as FedAvg sends it) and the
    objects the SuperLink asks for; returns the instructions' ids."""
    from flwr.proto.message_pb2 import PushObjectRequest
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PushAppMessagesRequest, PushAppMessagesResponse

    from fedvlm.deploy.object_batches import requests

    prompt = rng.standard_normal(PROMPT).astype(np.float32)
    parts = [_parts(_instruction(node, prompt, server_round)) for node, _ in nodes]
    request = PushAppMessagesRequest(messages_list=[p[0] for p in parts], message_object_trees=[p[1] for p in parts])
    pushed = await call.post("/v1/runtime/push-messages", request, call.runtime, PushAppMessagesResponse)
    contents = {i: c for p in parts for i, c in p[2].items()}
    server, push_objects = Node(node_id=1), requests()[1]
    items = [
        PushObjectRequest(
            node=server, run_id=run, object_id=i, object_content=contents[i], session_id=pushed.session_id
        )
        for i in pushed.objects_to_push
    ]
    await call.post("/v1/runtime/push-objects", push_objects(node=server, items=items), call.runtime)
    return [p[0].metadata.message_id for p in parts]


async def _node_answers(call: Caller, run: int, node: int, keys, rng) -> None:
    """One node's exchange as its SuperNode makes it: the instruction with its objects, a
    heartbeat, and the reply with its objects and the instruction's confirmation in one request."""
    from flwr.common.serde import message_from_proto
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatRequest
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest, PushObjectRequest
    from flwr.proto.node_pb2 import Node

    from fedvlm.deploy.object_batches import kinds

    kind, me = kinds(), Node(node_id=node)
    pulled = await call.post(
        "/v1/fleet/pull-message", kind["PullMessageRequest"](node=me), _signed(*keys), kind["PulledMessage"]
    )
    assert len(pulled.pulled.messages_list) == 1, "the node found no instruction"
    instruction = message_from_proto(pulled.pulled.messages_list[0])
    beat = SendNodeHeartbeatRequest(node=me, heartbeat_interval=30.0)
    await call.post("/v1/fleet/send-node-heartbeat", beat, _signed(*keys))
    proto, tree, contents = _parts(_reply(instruction, rng))
    push = PushMessagesRequest(
        node=me, messages_list=[proto], message_object_trees=[tree], clientapp_runtime_list=[1.5]
    )
    items = [PushObjectRequest(node=me, run_id=run, object_id=i, object_content=c) for i, c in contents.items()]
    confirm = ConfirmMessageReceivedRequest(node=me, run_id=run, message_object_id=instruction.metadata.message_id)
    request = kind["PushMessageRequest"](node=me, push=push, items=items, confirms=[confirm])
    await call.post("/v1/fleet/push-message", request, _signed(*keys))


async def _serverapp_takes(call: Caller, run: int, sent: list[str], nodes: int) -> None:
    """The ServerApp's pull of every reply, each reply's objects in one request, its confirmation."""
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest, PullObjectRequest
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullAppMessagesResponse
    from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree

    from fedvlm.deploy.object_batches import requests

    got = await call.post(
        "/v1/runtime/pull-messages", PullAppMessagesRequest(message_ids=sent), call.runtime, PullAppMessagesResponse
    )
    assert len(got.messages_list) == nodes, f"{len(got.messages_list)} replies of {nodes}"
    server, pull_objects = Node(node_id=1), requests()[0]
    for message, tree in zip(got.messages_list, got.message_object_trees, strict=True):
        asks = [PullObjectRequest(node=server, run_id=run, object_id=t.object_id) for t in iterate_object_tree(tree)]
        await call.post("/v1/runtime/pull-objects", pull_objects(node=server, items=asks), call.runtime)
        done = ConfirmMessageReceivedRequest(node=server, run_id=run, message_object_id=message.metadata.message_id)
        await call.post("/v1/runtime/confirm-message-received", done, call.runtime)


async def repeat(nodes: int, rounds: int, warm: int, seed: int) -> dict:
    """One federation on a fresh database: ``warm`` rounds, then ``rounds`` measured ones."""
    import httpx

    app = _app(Path(tempfile.mkdtemp(prefix="superlink-requests-")) / "state.db")
    run, token, federation = _federation(app, nodes)
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://superlink") as client:
        call = Caller(client, token)
        for r in range(warm + rounds):
            if r == warm:
                call.cpu.clear()
                start = time.process_time()
            sent = await _serverapp_sends(call, run, federation, r + 1, rng)
            for node, keys in federation:
                await _node_answers(call, run, node, keys, rng)
            await _serverapp_takes(call, run, sent, nodes)
        per_round = (time.process_time() - start) / rounds
    kinds = {
        k: {
            "per_round": len(v) / rounds,
            "ms_mean": statistics.fmean(v),
            "ms_median": statistics.median(v),
            "sql_statements_mean": statistics.fmean(call.sql[k]),
        }
        for k, v in sorted(call.cpu.items())
    }
    call.close()
    return {"cpu_s_per_round": per_round, "requests": kinds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", choices=THREADS, default="flower", help="what runs in worker threads (docstring)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    _inline_threads(args.threads)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # the deployed SuperLink logs to a file; not measured here
    runs: list[dict] = []

    async def repeats() -> None:  # one event loop for all: the held pulls' waker keeps the loop it began on
        for r in range(args.repeats):
            runs.append(await repeat(args.nodes, args.rounds, args.warm, seed=r))
            print(f"repeat {r + 1}: {runs[-1]['cpu_s_per_round']:.3f} CPU s a round of {args.nodes} nodes")

    asyncio.run(repeats())
    for kind in runs[0]["requests"]:
        shown = ", ".join(f"{run['requests'][kind]['ms_mean']:.1f}" for run in runs)
        count, sql = runs[0]["requests"][kind]["per_round"], runs[0]["requests"][kind]["sql_statements_mean"]
        print(f"  {kind:34s} {count:5.1f} a round, {sql:6.1f} SQL statements, ms CPU each: {shown}")
    report = bench_report(
        {"nodes": args.nodes, "rounds": args.rounds, "warm": args.warm, "threads": args.threads, "runs": runs}
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
