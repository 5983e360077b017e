"""Benchmark: the SuperLink's serial cost as the federation grows, with its nodes idle.

For each federation size (``--nodes``, e.g. 4,10,20,50) a real loopback federation
(``deploy.local_federation``: TLS, node authentication, the Fleet gateway, SQLite state; no
workers, since an idle node trains nothing) is started, and once every SuperNode is online the
CPU seconds of each program are measured over ``--seconds`` of idleness (``bench/measure.py``
``TreeCpu``): what a federation costs the SuperLink's one process before any round, per node and
second, with the SuperLink holding empty pulls (``--pull-hold``, the default 5 s) and answering
them at once as Flower does (``0``), side by side.

    python bench/superlink_scaling.py --nodes 4,10,20,50 --seconds 60 --out docs/results/superlink_scaling.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.deployment_speed import _wait_online
from bench.measure import TreeCpu, bench_report
from fedvlm.deploy.local_federation import LocalFederation
from fedvlm.utils.processes import TreeMemory

PROGRAMS = {"superlink": "fedvlm.deploy.superlink", "supernodes": "fedvlm.deploy.supernode_polling"}


def idle(nodes: int, hold: float, seconds: float) -> dict:
    names = [f"org-{i}" for i in range(nodes)]
    configs = {n: f"partition-id={i} num-partitions={nodes}" for i, n in enumerate(names)}
    with tempfile.TemporaryDirectory(prefix="fedvlm-scaling-") as tmp:
        t0 = time.time()
        with LocalFederation(Path(tmp) / "fed", names, configs, pull_hold=hold) as fed:
            _wait_online(fed, nodes, timeout=1200)
            started = time.time() - t0
            with TreeMemory(str(fed.dir), 1.0) as mem, TreeCpu(str(fed.dir)) as cpu:
                cpu.sample()
                cpu.zero = cpu.counted()  # from now: the federation up, every node idle
                time.sleep(seconds)
                by_program = cpu.by_program()
    per_s = {name: round(row["total"] / seconds, 4) for name, row in by_program.items()}
    return {
        "nodes": nodes,
        "pull_hold_s": hold,
        "start_s": round(started, 1),
        "idle_s": seconds,
        "cpu_s_per_s": per_s,
        "superlink_cpu_s_per_s_per_node": round(per_s.get(PROGRAMS["superlink"], 0.0) / nodes, 5),
        "all_cpu_s_per_s": round(sum(per_s.values()), 3),
        "peak_pss_gib": round(mem.peak_pss_mib / 1024, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="4,10,20", help="federation sizes, comma-separated")
    p.add_argument("--holds", default="5,0", help="--pull-hold values, comma-separated (0: Flower's)")
    p.add_argument("--seconds", type=float, default=60.0, help="idle seconds measured at each size")
    p.add_argument("--out", type=Path, default=Path("superlink_scaling.json"))
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        for hold in (float(h) for h in args.holds.split(",")):
            row = idle(n, hold, args.seconds)
            rows.append(row)
            link = row["cpu_s_per_s"].get(PROGRAMS["superlink"], 0.0)
            print(
                f"{n:3d} nodes, pull hold {hold:g} s: SuperLink {link:.3f} CPU s/s "
                f"({1000 * link / n:.1f} ms per node), "
                f"all programs {row['all_cpu_s_per_s']:.3f} CPU s/s, started in {row['start_s']:.0f} s, "
                f"peak {row['peak_pss_gib']} GiB",
                flush=True,
            )
    command = "python bench/superlink_scaling.py " + " ".join(sys.argv[1:])
    args.out.write_text(json.dumps(bench_report({"command": command, "rows": rows}), indent=2) + "\n")


if __name__ == "__main__":
    main()
