"""Benchmark: seconds per round of the embedded default, split into client compute and
Flower/Ray overhead, measured side by side in one run:
- ``flwr run`` (local SuperLink, Ray simulation, 10 ClientApps), as users run it;
- the same config through the in-process grid (no Ray, no SuperLink), which is pure compute
  plus Python message passing.

Client compute is what the ClientApps report spending on each message (setup, training,
evaluation); the remainder of a round's wall time is Flower/Ray overhead.

    python bench/round_overhead.py --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedvlm.utils.processes import flwr_env, flwr_run, kill_tree, pids_matching  # noqa: E402


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


def run_flwr(rounds: int, work: Path, cache: str) -> dict:
    home = work / "flwr-home"
    out = work / "runs"
    try:
        proc = flwr_run(
            flwr_env(home),
            f"num-server-rounds={rounds} output-dir='{out}' cache-dir='{cache}' run-name='flwr'",
            timeout=1800,
        )
    finally:
        for pid in pids_matching(str(home)):
            kill_tree(pid)
    if proc.returncode:
        raise SystemExit(f"flwr run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads((out / "flwr" / "results.json").read_text())


def run_inprocess(rounds: int, work: Path, cache: str) -> dict:
    from fedvlm.client_app.app import app
    from fedvlm.methods.registry import validate
    from fedvlm.server_app.app import execute
    from fedvlm.utils.inprocess import InProcessGrid

    cfg = validate(
        {"num-server-rounds": rounds, "output-dir": str(work / "runs"), "cache-dir": cache, "run-name": "inprocess"}
    )
    grid = InProcessGrid(app, [{"partition-id": i, "num-partitions": 10} for i in range(10)], cfg.as_dict())
    return execute(cfg, grid, "bench").data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cache-dir", default=os.environ.get("FEDVLM_CACHE", str(Path.home() / ".cache" / "fedvlm")))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = {
            "in-process (no Ray)": split(run_inprocess(args.rounds, work, args.cache_dir)),
            "flwr run (Ray simulation)": split(run_flwr(args.rounds, work, args.cache_dir)),
        }
    for name, row in rows.items():
        print(
            f"{name:28s} {row['wall_s_per_round']:.3f} s/round = "
            f"client compute {row['client_compute_s_per_round']:.3f} s"
            f" + overhead {row['overhead_s_per_round']:.3f} s ({100 * row['overhead_share']:.0f}% overhead)"
        )
    a, b = rows["flwr run (Ray simulation)"], rows["in-process (no Ray)"]
    print(f"flwr/Ray round time vs in-process: x{a['wall_s_per_round'] / b['wall_s_per_round']:.2f}")


if __name__ == "__main__":
    main()
