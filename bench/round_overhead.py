"""Benchmark: seconds per round of the embedded default, split into client compute and
Flower/Ray overhead, measured side by side in one run:
- ``flwr run`` (local SuperLink, Ray simulation, 10 ClientApps), as users run it;
- the same config through the in-process grid (no Ray, no SuperLink), which is pure compute
  plus Python message passing.

Client compute is what the ClientApps report spending on each message (setup, training,
evaluation); the remainder of a round's wall time is Flower/Ray overhead. With several methods
each is run in turn, ``--repeats`` times alternated, and its ``flwr run`` wall time (start-up
included) is compared with the first method's.

    python bench/round_overhead.py --rounds 10
    python bench/round_overhead.py --methods coop,pfedmoap --rounds 20 --repeats 2 --engines flwr
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from fedvlm.utils.processes import DEFAULT_SHARE, ClientShare, TreeMemory, flwr_env, flwr_run, kill_tree, pids_matching

ROOT = Path(__file__).resolve().parents[1]


def split(results: dict) -> dict:
    rounds = results["rounds"][1:]  # round 1 includes warm-up work; report steady state
    wall = np.array([r["seconds"] for r in rounds])
    compute = np.array(
        [r["metrics"].get("train-compute-seconds", 0) + r["metrics"].get("eval-compute-seconds", 0) for r in rounds]
    )
    return {
        "rounds": len(rounds),
        "wall_s_per_round": round(float(wall.mean()), 3),
        "client_compute_s_per_round": round(float(compute.mean()), 3),
        "overhead_s_per_round": round(float((wall - compute).mean()), 3),
        "overhead_share": round(float((wall - compute).sum() / wall.sum()), 3),
    }


def run_flwr(
    method: str,
    rounds: int,
    work: Path,
    cache: str,
    extra: dict | None = None,
    clients: int = 10,
    federation: str = "",
    memory: dict | None = None,
    share: ClientShare = DEFAULT_SHARE,
) -> tuple[dict, float]:
    """One ``flwr run`` (``extra``: further run-config keys; ``federation``: further
    ``--federation-config`` options; ``share``: each simulated client's threads and niceness);
    its results and wall time. ``memory``, if given, receives the process tree's peaks
    (``TreeMemory``: RSS, PSS, GPU)."""
    home = work / "flwr-home"
    out = work / "runs"
    raw = {
        "method": method,
        "num-server-rounds": rounds,
        "output-dir": str(out),
        "cache-dir": cache,
        "run-name": "flwr",
        **(extra or {}),
    }
    t0 = time.time()
    try:
        with TreeMemory(str(home)) as mem:
            federation = f"{share.federation()} {federation}"
            proc = flwr_run(flwr_env(home, share), raw, clients, timeout=3600, federation=federation)
    finally:
        for pid in pids_matching(str(home)):
            kill_tree(pid)
    if memory is not None:
        memory.update(rss_mib=mem.peak_rss_mib, pss_mib=mem.peak_pss_mib, gpu_mib=mem.peak_gpu_mib)
    results = out / "flwr" / "results.json"
    if proc.returncode or not results.exists():
        raise SystemExit(f"flwr run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(results.read_text()), time.time() - t0


def run_inprocess(
    method: str, rounds: int, work: Path, cache: str, extra: dict | None = None, clients: int = 10
) -> tuple[dict, float]:
    from fedvlm.client_app.app import app
    from fedvlm.methods.validation import validate
    from fedvlm.server_app.app import execute
    from fedvlm.utils.inprocess import InProcessGrid

    cfg = validate(
        {
            "method": method,
            "num-server-rounds": rounds,
            "output-dir": str(work / "runs"),
            "cache-dir": cache,
            "run-name": "inprocess",
            **(extra or {}),
        }
    )
    nodes = [{"partition-id": i, "num-partitions": clients} for i in range(clients)]
    grid = InProcessGrid(app, nodes, cfg.as_dict())
    t0 = time.time()
    data = execute(cfg, grid, "bench").data
    return data, time.time() - t0


ENGINES = {"in-process (no Ray)": ("inprocess", run_inprocess), "flwr run (Ray simulation)": ("flwr", run_flwr)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--methods", default="promptfl")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--engines", default="inprocess,flwr")
    parser.add_argument("--cache-dir", default=os.environ.get("FEDVLM_CACHE", str(Path.home() / ".cache" / "fedvlm")))
    args = parser.parse_args()
    methods = args.methods.split(",")
    engines = {name: fn for name, (key, fn) in ENGINES.items() if key in args.engines.split(",")}
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for method in methods:
            for name, fn in engines.items():
                with tempfile.TemporaryDirectory() as tmp:
                    data, wall = fn(method, args.rounds, Path(tmp), args.cache_dir)
                rows.setdefault((method, name), []).append({**split(data), "run_wall_s": wall})
    for (method, name), runs in rows.items():
        row = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
        walls = ", ".join(f"{r['run_wall_s']:.1f}" for r in runs)
        print(
            f"{method:10s} {name:28s} {row['wall_s_per_round']:.3f} s/round = "
            f"client compute {row['client_compute_s_per_round']:.3f} s"
            f" + overhead {row['overhead_s_per_round']:.3f} s ({100 * row['overhead_share']:.0f}% overhead); "
            f"whole run {walls} s"
        )
        rows[(method, name)] = [row]
    for name in engines:
        base = rows[(methods[0], name)][0]
        for method in methods[1:]:
            row = rows[(method, name)][0]
            per_round = row["wall_s_per_round"] / base["wall_s_per_round"]
            print(
                f"{name}: {method} vs {methods[0]}: round time x{per_round:.2f}, "
                f"whole run x{row['run_wall_s'] / base['run_wall_s']:.2f}"
            )
    if len(engines) == 2:
        for method in methods:
            a, b = rows[(method, "flwr run (Ray simulation)")][0], rows[(method, "in-process (no Ray)")][0]
            print(f"{method}: flwr/Ray round time vs in-process: x{a['wall_s_per_round'] / b['wall_s_per_round']:.2f}")


if __name__ == "__main__":
    main()
