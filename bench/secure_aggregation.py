"""Benchmark: what secure aggregation costs, and what distributed noise costs in accuracy.

``cost``: seconds and bytes per round of the embedded default (PromptFL; DP-FPL with privacy,
whose noise the clients then draw in shares), with and without ``secure-aggregation.enabled``,
at 4, 10 and 20 nodes (and SecAgg+ with ``--neighbours`` k where k < n - 1), side by side in one
process through the in-process grid (the ClientApp's handlers on Flower messages, no Ray and no
SuperLink: compute plus message passing; every node's and the server's work on one machine).
Round 1 is left out (warm-up). Bytes are what the run's records count: tensors down and up, and
the secure stages' keys, shares and masked vectors.

``protocol``: one round of the protocol alone (no training), every party in this process: seconds
per stage for 4, 10 and 20 nodes (``--nodes``), the consistency round's share among them,
``--repeats`` times. ``cost`` also reports each later stage's seconds per round of the secure runs.

``attack``: a server that deviates (``tests/secagg_harness``: one that tells groups of nodes
stories of their own, one that targets a node with two stories) against real nodes, with the
consistency round's majority and without it: the rounds in which it could unmask fewer than t.

``accuracy``: DP-FPL at one privacy.epsilon on the embedded default, the server's Gaussian
(central) against the clients' distributed discrete Gaussian (secure aggregation), for several
seeds: the final round's local and neighbour accuracy, and the sigma each drew on the mean.

    python -m bench.secure_aggregation cost --nodes 4,10,20 --rounds 3 --neighbours 6
    python -m bench.secure_aggregation protocol --nodes 4,10,20 --repeats 3
    python -m bench.secure_aggregation accuracy --seeds 0,1,2 --rounds 20 --epsilon 8
    python -m bench.secure_aggregation attack --configs 7:0,7:2,9:4,11:4,13:6 --rounds 12

Prints one JSON line per measurement and a table; ``--out FILE`` writes the JSON list.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.measure import bench_report


def run(overrides: dict, nodes: int, work: Path, run_id: str) -> tuple[dict, float]:
    from fedvlm.client_app.app import app as client_app
    from fedvlm.methods.validation import validate
    from fedvlm.server_app.app import execute
    from fedvlm.utils.inprocess import InProcessGrid

    cfg = validate({"output-dir": str(work / "runs"), **overrides})
    grid = InProcessGrid(
        client_app, [{"partition-id": i, "num-partitions": nodes} for i in range(nodes)], cfg.as_dict()
    )
    t0 = time.perf_counter()
    rec = execute(cfg, grid, run_id=run_id)
    return json.loads(rec.path.read_text()), time.perf_counter() - t0


def per_round(data: dict) -> dict:
    from fedvlm.strategies.records import TRAFFIC_KEYS

    rounds = data["rounds"][1:] or data["rounds"]
    mean = statistics.fmean
    return {
        "seconds_per_round": round(mean(r["seconds"] for r in rounds), 3),
        **{f"mb_{k.replace('_bytes', '')}_per_round": round(mean(r[k] for r in rounds) / 1e6, 4) for k in TRAFFIC_KEYS},
        "secure_mb_down_per_round": round(mean(r["bytes"].get("secure_down", 0) for r in rounds) / 1e6, 4),
        "secure_mb_up_per_round": round(mean(r["bytes"].get("secure_up", 0) for r in rounds) / 1e6, 4),
    }


def cost(args, work: Path) -> list[dict]:
    out = []
    methods = {
        "promptfl": {"method": "promptfl", "replies.max-norm": 100.0},
        "dpfpl-dp": {"method": "dpfpl", "privacy.epsilon": 8.0},
    }
    for n in [int(x) for x in args.nodes.split(",")]:
        for name, overrides in methods.items():
            for secure, k in (
                (False, 0),
                (True, 0),
                *(((True, args.neighbours),) if 0 < args.neighbours < n - 1 else ()),
            ):
                o = {**overrides, "num-server-rounds": args.rounds, "secure-aggregation.enabled": secure}
                o["secure-aggregation.neighbours"] = k
                data, wall = run(o, n, work, f"{name}-{n}-{int(secure)}-{k}")
                row = {"nodes": n, "method": name, "secure": secure, "neighbours": k if secure else None}
                row.update({**per_round(data), "wall_s": round(wall, 1)})
                if secure:  # each later stage's seconds per round, the consistency round's among them
                    stages = [r["secure_aggregation"]["stage_seconds"] for r in data["rounds"][1:] or data["rounds"]]
                    for stage in stages[0]:
                        row[f"{stage}_s"] = round(statistics.fmean(x.get(stage, 0.0) for x in stages), 4)
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def accuracy(args, work: Path) -> list[dict]:
    out = []
    for seed in [int(x) for x in args.seeds.split(",")]:
        for secure in (False, True):
            o = {
                "method": "dpfpl",
                "privacy.epsilon": args.epsilon,
                "num-server-rounds": args.rounds,
                "seed": seed,
                "secure-aggregation.enabled": secure,
            }
            data, wall = run(o, args.clients, work, f"acc-{seed}-{int(secure)}")
            last = data["rounds"][-1]["metrics"]
            (plan,) = data["privacy"]["mechanisms"].values()
            row = {
                "seed": seed,
                "noise": "distributed" if secure else "central",
                "local_acc": round(last["local-acc"], 4),
                "neighbor_acc": round(last["neighbor-acc"], 4),
                "epsilon": round(data["privacy"]["rounds"][-1]["epsilon"], 4),
                "global_sigma_on_mean": round(plan["sigma"], 5),
                "wall_s": round(wall, 1),
            }
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def protocol_round(plan, roster, identities, size: int) -> dict[str, float]:
    """One round of the protocol alone, every party in this process: seconds per stage (the
    nodes' work on it and the server's on their replies)."""
    import numpy as np

    from fedvlm.secagg.masks import encode
    from fedvlm.secagg.node import NodeRound
    from fedvlm.secagg.server import ServerRound

    clock: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(name: str):
        t0 = time.perf_counter()
        yield
        clock[name] = clock.get(name, 0.0) + time.perf_counter() - t0

    ids = list(plan.participants)
    server = ServerRound(plan, size, roster)
    with stage("keys"):
        started = {u: NodeRound.start(u, plan, roster, identities[u]) for u in ids}
        shown = server.take_adverts({u: advert for u, (_, advert) in started.items()})
    nodes = {u: node for u, (node, _) in started.items()}
    with stage("shares"):  # the masked vector goes with the shares
        zeros = encode(np.zeros(size, dtype=np.int64), plan.bits)
        routed = server.take_shares({u: (*nodes[u].share(shown, roster), nodes[u].mask(zeros)) for u in shown})
    with stage("consistency"):
        survivors = sorted(server.masked)
        for u, ciphertexts in routed.items():
            nodes[u].receive(server.dealt, ciphertexts)
        story = {u: (nodes[u].sign_story(survivors, identities[u]), sorted(nodes[u].complaints)) for u in survivors}
        signatures = server.take_signatures(story)
    with stage("unmask"):
        server.unmask({u: nodes[u].reveal(signatures) for u in signatures})
    return clock


def protocol(args, work: Path) -> list[dict]:
    from fedvlm.secagg.graph import degree
    from fedvlm.secagg.node import majority_threshold
    from fedvlm.secagg.roster import Identity, Roster
    from fedvlm.secagg.stages import SumPlan

    out = []
    for n in [int(x) for x in str(args.nodes).split(",")]:
        ids = list(range(100, 100 + n))
        roster = Roster.simulated(0, n)
        identities = {u: Identity.simulated(0, i) for i, u in enumerate(ids)}
        k = args.neighbours if 0 < args.neighbours < n - 1 else 0
        t = max(2, majority_threshold(degree(k, n) + 1))
        plan = SumPlan(1, tuple(ids), k, t, 32, ("x",), (args.size - 1,), False, 1.0, 1.0, 0.0, 0, roster.digest)
        for _ in range(args.repeats):
            clock = protocol_round(plan, roster, identities, args.size)
            total = sum(clock.values())
            row = {"nodes": n, "neighbours": k, "coordinates": args.size, "seconds": round(total, 3)}
            row.update({f"{name}_s": round(v, 4) for name, v in clock.items()})
            row["consistency_share"] = round(clock["consistency"] / total, 4)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def attack(args, work: Path) -> list[dict]:
    """A server that deviates, against real nodes (``tests/secagg_harness``): for each configuration
    and attacker, the rounds in which it could unmask a sum of fewer than t nodes, with the
    consistency round as built and with its majority taken away (a node revealing on its
    neighbourhood's signatures alone)."""
    import numpy as np

    from fedvlm.secagg import node as node_module
    from tests.secagg_harness import ATTACKS, unmaskable  # run from the checkout's root, as a module

    built = node_module.quorum
    out = []
    for config in args.configs.split(","):
        n, k = (int(x) for x in config.split(":"))
        for name, attacker in ATTACKS.items():
            for quorum in ("majority", "none"):
                node_module.quorum = built if quorum == "majority" else (lambda participants: 1)
                rng = np.random.default_rng(args.seed)
                small = single = 0
                for _ in range(args.rounds):
                    r, masked, revealed = attacker(n, k, rng)
                    sizes = [len(m) for m in unmaskable(r, set(masked), revealed)]
                    small += any(size < r.t for size in sizes)
                    single += any(size == 1 for size in sizes)
                node_module.quorum = built
                row = {"nodes": n, "neighbours": k, "threshold": r.t, "attacker": name, "quorum": quorum}
                row.update({"rounds": args.rounds, "fewer_than_t": small, "single_node": single, "seed": args.seed})
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--nodes", default="4,10,20")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--neighbours", type=int, default=6, help="also SecAgg+ with this degree where it is below n - 1")
    a = sub.add_parser("accuracy")
    a.add_argument("--seeds", default="0,1,2")
    a.add_argument("--rounds", type=int, default=20)
    a.add_argument("--epsilon", type=float, default=8.0)
    a.add_argument("--clients", type=int, default=10)
    r = sub.add_parser("protocol")
    r.add_argument("--nodes", default="4,10,20")
    r.add_argument(
        "--neighbours", type=int, default=0, help="SecAgg+'s degree where it is below n - 1 (0: every other)"
    )
    r.add_argument("--size", type=int, default=1553, help="coordinates of a vector (the default: DP-FPL's)")
    r.add_argument("--repeats", type=int, default=3)
    t = sub.add_parser("attack")
    t.add_argument("--configs", default="7:0,7:2,9:4,11:4,13:6", help="nodes:neighbours, comma-separated")
    t.add_argument("--rounds", type=int, default=12)
    t.add_argument("--seed", type=int, default=7)
    for p in (c, a, r, t):
        p.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {"cost": cost, "accuracy": accuracy, "protocol": protocol, "attack": attack}[args.what](args, Path(tmp))
    if args.out:
        args.out.write_text(json.dumps(bench_report(rows), indent=1))


if __name__ == "__main__":
    main()
