"""Benchmark: peak memory and time of a ``flwr run`` simulation as the number of simulated
clients grows, with the clients sampled per round held fixed (``--sampled 10``: fraction-train =
10 / N) or a fixed share of them (``--sampled 10%``). Memory is the summed RSS and PSS of the whole
process tree (SuperLink, ServerApp, simulation, Ray workers), sampled every 0.5 s; PSS counts each
shared page once. Time: the median round after the first (the rounds' own ``seconds``), and what
the run spends outside its rounds (Ray's start, every node's handshake, the end's plots). Sizes:
results.json, the checkpoint and the whole run folder at the end.

    python bench/simulation_memory.py                       # pfedmoap, 10 vs 100 clients, 5 rounds, all evaluated
    python bench/simulation_memory.py --clients 10,50,100 --set method=promptfl
    python bench/simulation_memory.py --clients 100,1000,100,1000 --sampled 10 --evaluated sampled \
        --images-per-client 26 --set method=promptfl partitioner=iid    # the scale check of docs/results/speed.md

``--images-per-client K`` grows the embedded dataset with the clients (``embedded-per-class`` =
K x N / 40), so that a client's work is the same at every size and only the federation grows.

Writes ``--out`` (JSON) and prints one line per run, then the largest size against the smallest
(the median of each size's repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fedvlm.runconfig import parse_value
from fedvlm.utils.processes import TreeMemory, flwr_env, flwr_run, kill_tree, pids_matching

ROOT = Path(__file__).resolve().parents[1]


def sampled_of(spec: str, clients: int) -> int:
    """``--sampled``: a count ('10') or a share ('10%') of ``clients``."""
    if spec.endswith("%"):
        return max(1, round(clients * float(spec[:-1]) / 100))
    return min(clients, int(spec))


def folder_kib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1024


def measure(
    clients: int, rounds: int, extra: dict, cache: str, work: Path, sampled: int, evaluate_sampled: bool
) -> dict:
    name = f"n{clients}-{len(list(work.glob('home-*')))}"  # each repeat its own run folder and Flower home
    home, out = work / f"home-{name}", work / "runs"
    raw = {
        "method": "pfedmoap",
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.5,
        "fraction-train": sampled / clients,
        **({"fraction-evaluate": sampled / clients} if evaluate_sampled else {}),
        "num-server-rounds": rounds,
        "output-dir": str(out),
        "cache-dir": cache,
        "run-name": name,
        **extra,
    }
    t0 = time.time()
    try:
        with TreeMemory(str(home)) as mem:
            proc = flwr_run(flwr_env(home), raw, clients, timeout=3600)
    finally:
        for pid in pids_matching(str(home)):
            kill_tree(pid)
    wall = time.time() - t0
    run_dir = out / name
    results = run_dir / "results.json"
    if not results.exists():
        raise SystemExit(f"flwr run with {clients} clients failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    data = json.loads(results.read_text())
    seconds = [r["seconds"] for r in data["rounds"]]
    checkpoint = run_dir / "checkpoint.pt"
    return {
        "clients": clients,
        "trained_per_round": sampled,
        "evaluated_per_round": sampled if evaluate_sampled else clients,
        "status": data["run"]["status"],
        "rounds": len(data["rounds"]),
        "wall_s": round(wall, 1),
        "seconds_per_round": round(statistics.median(seconds[1:] or seconds), 2),
        "outside_rounds_s": round(wall - sum(seconds), 1),
        "peak_rss_mib": round(mem.peak_rss_mib),
        "peak_pss_mib": round(mem.peak_pss_mib),
        "results_json_kib": round(results.stat().st_size / 1024, 1),
        "checkpoint_kib": round(checkpoint.stat().st_size / 1024, 1) if checkpoint.exists() else None,
        "run_folder_kib": round(folder_kib(run_dir), 1),
        "final_local_acc": data["final"].get("local-acc"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="10,100")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sampled", default="10", help="clients trained per round: a count, or a share like 10%%")
    p.add_argument(
        "--evaluated",
        choices=("all", "sampled"),
        default="all",
        help="evaluate every client each round, or as many as train",
    )
    p.add_argument(
        "--images-per-client",
        type=int,
        default=0,
        help="grow the embedded dataset to this many training images a client",
    )
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=Path("simulation_memory.json"))
    p.add_argument("--cache-dir", default=os.environ.get("FEDVLM_CACHE", str(Path.home() / ".cache" / "fedvlm")))
    args = p.parse_args()
    extra = {k: parse_value(v) for k, _, v in (s.partition("=") for s in args.set)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(c) for c in args.clients.split(",")):
            sampled = sampled_of(args.sampled, n)
            per_class = max(8, round(args.images_per_client * n / 40))
            size = {"embedded-per-class": per_class} if args.images_per_client else {}
            rows.append(
                measure(n, args.rounds, extra | size, args.cache_dir, Path(tmp), sampled, args.evaluated == "sampled")
            )
            r = rows[-1]
            print(
                f"{n:5d} clients ({r['trained_per_round']} train, {r['evaluated_per_round']} evaluated per round, "
                f"{r['rounds']} rounds, {r['status']}): {r['seconds_per_round']} s per round, "
                f"{r['outside_rounds_s']} s outside rounds, peak RSS {r['peak_rss_mib']} MiB, peak PSS "
                f"{r['peak_pss_mib']} MiB, results.json {r['results_json_kib']} KiB, checkpoint {r['checkpoint_kib']} "
                f"KiB, run folder {r['run_folder_kib']} KiB, {r['wall_s']} s, final local acc "
                f"{100 * (r['final_local_acc'] or 0):.1f}%",
                flush=True,
            )
    keys = ("seconds_per_round", "outside_rounds_s", "peak_pss_mib", "peak_rss_mib", "results_json_kib", "wall_s")
    sizes = sorted({r["clients"] for r in rows})  # each size's median over its repeats, largest vs smallest
    median = {n: {k: statistics.median(r[k] for r in rows if r["clients"] == n) for k in keys} for n in sizes}
    small, large = median[sizes[0]], median[sizes[-1]]
    ratio = {k: large[k] / small[k] for k in keys if small[k]}
    print(
        f"{sizes[-1]} vs {sizes[0]} clients (medians of each size's repeats): "
        + ", ".join(f"{k} x{v:.2f}" for k, v in ratio.items())
    )
    args.out.write_text(
        json.dumps({"argv": sys.argv[1:], "config": extra, "rows": rows, "largest_vs_smallest": ratio}, indent=2)
    )


if __name__ == "__main__":
    main()
