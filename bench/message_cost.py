"""Benchmark: what one message costs a deployed node, phase by phase, cold and warm.

A deployed SuperNode starts a fresh ``flwr-clientapp`` process for every message. This takes a
real train message of the method (made by the real strategy in process, with the node's
``Context`` as it was when the message came) and runs it, ``--repeats`` times each:

- cold: a fresh Python process, as Flower's per-message process: imports (torch, the project),
  the node's data, the backbone, its image features (from the warm disk cache, as on a node's
  second message), then the message itself; the phases are timed one by one;
- warm worker: the node's worker (``python -m fedvlm.deploy.node_worker``) already holds all of
  that; a fresh process that imports only what the ClientApp needs forwards the message, and
  the overhead is that process's wall time minus the worker's own time on the message.

Prints the phases, the per-message overhead (cold: everything but training; warm: process
start, imports, serialisation and the socket) and their ratio, with the machine and its load.

    python bench/message_cost.py                       # the embedded tiny CLIP, promptfl
    python bench/message_cost.py --set clip.model=ViT-B-16 --set clip.pretrained= --set max-per-class=4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import bench_report
from fedvlm.deploy.node_worker import spawn
from fedvlm.runconfig import parse_value

ROOT = Path(__file__).resolve().parents[1]

COLD = """
import sys, time, json
t0 = time.perf_counter()
import torch
from flwr.common.serde import message_from_proto, context_from_proto
from flwr.proto.message_pb2 import Message as M, Context as C
from fedvlm.client_app.handlers import handle
from fedvlm.methods.validation import validate
from fedvlm.spec import spec_of
t_import = time.perf_counter()
m, c = M(), C()
m.ParseFromString(open(sys.argv[1], "rb").read()); c.ParseFromString(open(sys.argv[2], "rb").read())
msg, ctx = message_from_proto(m), context_from_proto(c)
cfg = validate(ctx.run_config)
spec = spec_of(cfg)
node = spec.family.node_data(cfg, dict(ctx.node_config))
t_data = time.perf_counter()
client = spec.client(cfg, node, ctx.state, 1)  # loads the backbone
t_model = time.perf_counter()
client.hello()  # the node's image features, from the disk cache
t_features = time.perf_counter()
reply = handle(msg, ctx)
t_message = time.perf_counter()
assert not reply.has_error(), reply.error
print(json.dumps({"import": t_import - t0, "data": t_data - t_import, "model": t_model - t_data,
                  "features": t_features - t_model, "message": t_message - t_features}))
"""

FORWARD = """
import sys, time, json
t0 = time.perf_counter()
from flwr.common.serde import message_from_proto, context_from_proto
from flwr.proto.message_pb2 import Message as M, Context as C
from fedvlm.client_app.worker import forward
import fedvlm.client_app.app
m, c = M(), C()
m.ParseFromString(open(sys.argv[1], "rb").read()); c.ParseFromString(open(sys.argv[2], "rb").read())
reply = forward(message_from_proto(m), context_from_proto(c), sys.argv[3])
assert reply is not None and not reply.has_error(), reply
print(json.dumps({"forwarded": time.perf_counter() - t0, "torch_imported": "torch" in sys.modules}))
"""


def capture(overrides: dict, work: Path) -> tuple[Path, Path]:
    """Run round 1 in process; save node 0's train message and its Context as it came."""
    from flwr.common.serde import context_to_proto, message_to_proto

    from fedvlm.client_app.app import app as client_app
    from fedvlm.methods.validation import validate
    from fedvlm.server_app.app import execute
    from fedvlm.utils.inprocess import InProcessGrid

    cfg = validate({"num-server-rounds": 1, "output-dir": str(work / "runs"), **overrides})
    saved: dict[str, bytes] = {}

    def forge(msg):
        if msg.metadata.message_type == "train" and msg.metadata.dst_node_id == 1000 and not saved:
            saved["msg"] = message_to_proto(msg).SerializeToString()
            saved["ctx"] = context_to_proto(grid.contexts[1000]).SerializeToString()
        return None  # the node answers for itself

    nodes = [{"partition-id": i, "num-partitions": 2} for i in range(2)]
    grid = InProcessGrid(client_app, nodes, cfg.as_dict(), forge=forge)
    execute(cfg, grid, run_id="bench")
    (work / "msg.pb").write_bytes(saved["msg"])
    (work / "ctx.pb").write_bytes(saved["ctx"])
    return work / "msg.pb", work / "ctx.pb"


def child(script: str, *args: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1]), wall


def worker_time(log: Path, count: int) -> float:
    """The worker's own seconds on its ``count``-th message (its log line)."""
    lines = [ln for ln in log.read_text().splitlines() if "served train" in ln]
    return float(lines[count - 1].split(" in ")[1].split(" s ")[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="promptfl")
    p.add_argument("--set", action="append", default=[], help="run config key=value (repeatable)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "fedvlm"))
    p.add_argument("--out", default="bench_message_cost.json")
    args = p.parse_args()
    overrides = {"method": args.method, "cache-dir": args.cache_dir}
    for kv in args.set:
        key, _, value = kv.partition("=")
        overrides[key] = parse_value(value)
    work = Path(tempfile.mkdtemp(prefix="fedvlm-msgcost-"))
    msg, ctx = capture(overrides, work)

    sock = work / "worker" / "node.sock"
    log = work / "worker.log"
    worker = spawn(sock, log)
    try:
        child(FORWARD, str(msg), str(ctx), str(sock))  # the worker's first message loads everything once
        cold, warm = [], []
        for i in range(args.repeats):  # alternated, so that load changes hit both alike
            phases, wall = child(COLD, str(msg), str(ctx))
            cold.append({**phases, "process_wall": wall})
            fwd, wall = child(FORWARD, str(msg), str(ctx), str(sock))
            served = worker_time(log, i + 2)
            warm.append({"process_wall": wall, "worker_message": served, "overhead": wall - served, **fwd})
    finally:
        worker.terminate()
        worker.wait(timeout=30)

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    cold_overhead = mean(cold, "process_wall") - mean(cold, "message")
    report = {
        "config": overrides,
        "machine": {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]},
        "cold": cold,
        "warm": warm,
        "cold_overhead_s": cold_overhead,
        "warm_overhead_s": mean(warm, "overhead"),
        "ratio_cold_to_warm_per_message": mean(cold, "process_wall") / mean(warm, "process_wall"),
    }
    Path(args.out).write_text(json.dumps(bench_report(report), indent=2))
    print(f"{args.method} {overrides}: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("cold message (a fresh process per message, as Flower runs a ClientApp), mean of", args.repeats)
    for key in ("import", "data", "model", "features", "message", "process_wall"):
        print(f"  {key:<14}{mean(cold, key):8.2f} s")
    print("warm worker:")
    for key in ("process_wall", "worker_message", "overhead"):
        print(f"  {key:<14}{mean(warm, key):8.2f} s")
    print(f"  torch imported by the forwarding ClientApp: {any(r['torch_imported'] for r in warm)}")
    print(
        f"per-message overhead: cold {cold_overhead:.2f} s, warm {report['warm_overhead_s']:.2f} s; "
        f"a message costs {report['ratio_cold_to_warm_per_message']:.1f}x less wall time warm; {args.out}"
    )


if __name__ == "__main__":
    main()
