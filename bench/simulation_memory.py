"""Benchmark: peak memory and wall time of a ``flwr run`` simulation as the number of simulated
clients grows, with the work per round held fixed (10 clients train per round: fraction-train =
10 / N). Memory is the summed RSS and PSS of the whole process tree (SuperLink, ServerApp,
simulation, Ray workers), sampled every 0.5 s; PSS counts each shared page once.

    python bench/simulation_memory.py                       # pfedmoap, 10 vs 100 clients, 5 rounds
    python bench/simulation_memory.py --clients 10,50,100 --set method=promptfl

Writes ``--out`` (JSON) and prints one line per size and the 100-vs-10 ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedvlm.runconfig import parse_value  # noqa: E402
from fedvlm.utils.processes import TreeMemory, flwr_env, flwr_run, kill_tree, pids_matching  # noqa: E402


def measure(clients: int, rounds: int, extra: dict, cache: str, work: Path) -> dict:
    home, out = work / f"home-{clients}", work / "runs"
    raw = {
        "method": "pfedmoap",
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.5,
        "fraction-train": min(1.0, 10 / clients),
        "num-server-rounds": rounds,
        "output-dir": str(out),
        "cache-dir": cache,
        "run-name": f"n{clients}",
        **extra,
    }
    t0 = time.time()
    try:
        with TreeMemory(str(home)) as mem:
            proc = flwr_run(flwr_env(home), raw, clients, timeout=3600)
    finally:
        for pid in pids_matching(str(home)):
            kill_tree(pid)
    results = out / f"n{clients}" / "results.json"
    if not results.exists():
        raise SystemExit(f"flwr run with {clients} clients failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    data = json.loads(results.read_text())
    return {
        "clients": clients,
        "trained_per_round": min(10, clients),
        "status": data["run"]["status"],
        "rounds": len(data["rounds"]),
        "wall_s": round(time.time() - t0, 1),
        "peak_rss_mib": round(mem.peak_rss_mib),
        "peak_pss_mib": round(mem.peak_pss_mib),
        "final_local_acc": data["final"].get("local-acc"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="10,100")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=Path("simulation_memory.json"))
    p.add_argument("--cache-dir", default=os.environ.get("FEDVLM_CACHE", str(Path.home() / ".cache" / "fedvlm")))
    args = p.parse_args()
    extra = {k: parse_value(v) for k, _, v in (s.partition("=") for s in args.set)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(c) for c in args.clients.split(",")):
            rows.append(measure(n, args.rounds, extra, args.cache_dir, Path(tmp)))
            r = rows[-1]
            print(
                f"{n:4d} clients ({r['trained_per_round']} train per round, {r['rounds']} rounds, {r['status']}): "
                f"peak RSS {r['peak_rss_mib']} MiB, peak PSS {r['peak_pss_mib']} MiB, {r['wall_s']} s, "
                f"final local acc {100 * (r['final_local_acc'] or 0):.1f}%",
                flush=True,
            )
    first, last = rows[0], rows[-1]
    ratio = {k: last[k] / first[k] for k in ("peak_pss_mib", "peak_rss_mib", "wall_s")}
    print(
        f"{last['clients']} vs {first['clients']} clients: peak PSS x{ratio['peak_pss_mib']:.2f}, "
        f"peak RSS x{ratio['peak_rss_mib']:.2f}, wall x{ratio['wall_s']:.2f}"
    )
    args.out.write_text(json.dumps({"config": extra, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
