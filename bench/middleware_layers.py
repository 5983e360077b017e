"""Benchmark: the SuperLink app's CPU per request with Flower's eight middlewares, and with the six
API-specific ones behind their gates (``deploy.scoped_middlewares``).

Flower's own SuperLink app (``flwr.superlink.main.create_app``, in-memory state) is built twice,
as Flower builds it and gated, and served in this process through httpx's ASGI transport (no
sockets: what is measured is the app). Each probe is sent ``--requests`` times after a warm-up,
and the process's CPU time per request is taken; the two apps alternate ``--repeats`` times so that
load on the machine falls on both. Probes: a node's signed Fleet heartbeat (answered 200, the
shape of every Fleet call: node authentication, then the handler) and a runtime call without a
task token (refused by Flower's token check, the shape of the ServerApp's and SuperExec's calls).

    python -m bench.middleware_layers --requests 400 --repeats 3 --out docs/results/scoped_middlewares/per_request.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path

from bench.measure import bench_report
from fedvlm.deploy import scoped_middlewares
from tests.unit.test_object_batches import _signed

_FLOWER: dict = {}  # Flower's own middleware list, kept before the first gating


def _app(gated: bool):
    from flwr.superlink import main

    main._get_middleware = _FLOWER.setdefault("list", main._get_middleware)
    if gated:
        assert scoped_middlewares.install(), "the guard refused the installed Flower"
    return main.create_app()


def _probes(app) -> dict[str, tuple[str, bytes, dict]]:
    from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatRequest
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

    keys = generate_key_pairs()
    node = app.state.linkstate_factory.state().create_node("acct", "org-a", public_key_to_bytes(keys[1]), 30.0)
    beat = SendNodeHeartbeatRequest(node=Node(node_id=node), heartbeat_interval=30.0).SerializeToString()
    return {
        "fleet heartbeat (200)": ("/v1/fleet/send-node-heartbeat", beat, _signed(*keys)),
        "runtime call, no token (401)": ("/v1/runtime/get-nodes", b"", {"content-type": "application/protobuf"}),
    }


async def _cpu_per_request(app, path: str, body: bytes, headers: dict, requests: int) -> float:
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://superlink") as client:
        for _ in range(20):
            await client.post(path, content=body, headers=headers)
        t = time.process_time()
        for _ in range(requests):
            await client.post(path, content=body, headers=headers)
        return (time.process_time() - t) / requests * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    logging.getLogger("flwr").setLevel(logging.CRITICAL)  # the refused probe logs an error per request
    ms: dict[str, dict[str, list[float]]] = {}
    for rep in range(args.repeats):
        for gated in (False, True):
            app = _app(gated)
            for probe, (path, body, headers) in _probes(app).items():
                cpu = asyncio.run(_cpu_per_request(app, path, body, headers, args.requests))
                ms.setdefault(probe, {}).setdefault("gated" if gated else "flower", []).append(cpu)
                print(f"repeat {rep + 1}: {probe}, {'gated ' if gated else 'Flower'}: {cpu:.3f} ms CPU a request")
    rows = []
    for probe, by in ms.items():
        ratios = [g / f for f, g in zip(by["flower"], by["gated"], strict=True)]
        rows.append(
            {
                "probe": probe,
                "flower_ms": by["flower"],
                "gated_ms": by["gated"],
                "gated_over_flower": ratios,
                "median_ratio": statistics.median(ratios),
            }
        )
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{probe}: gated / Flower = {shown} (median {rows[-1]['median_ratio']:.2f})")
    report = bench_report({"requests": args.requests, "repeats": args.repeats, "rows": rows})
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
