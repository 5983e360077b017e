"""What torch's OpenMP threads cost when processes share the cores: the embedded motif ResNet's
pretraining (the longest of the image's build stages; a short run of its recipe), alone and two
side by side, with libgomp's default (threads spin for a while after each parallel region, then
sleep; ``OMP_WAIT_POLICY`` unset), with threads that only spin (``ACTIVE``) and with threads that
sleep at once (``PASSIVE``, which the Docker image's pretraining stages set). Each run is a fresh
process, since OpenMP reads the policy once, when torch loads it; the modes alternate, and each is
repeated.

    python bench/omp_wait_policy.py --steps 60 --repeats 2 --json docs/results/omp_wait_policy.json \
        --csv docs/results/omp_wait_policy.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.measure import bench_report

POLICIES = ("default", "ACTIVE", "PASSIVE")
RUN = (
    "import dataclasses, time; from fedvlm.models import embedded_resnet as er; "
    "r = dataclasses.replace(er.SOURCES['embedded-motif-resnet'], steps={steps}); "
    "t = time.time(); er.pretrain(r); print(time.time() - t)"
)


def timed(policy: str, together: int, steps: int) -> float:
    """Wall seconds until ``together`` pretrainings started at once have all finished."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    t0 = time.time()
    procs = [
        subprocess.Popen([sys.executable, "-c", RUN.format(steps=steps)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(together)
    ]
    for p in procs:
        p.communicate()
        if p.returncode:
            raise SystemExit(f"a pretraining failed ({policy}, {together} at once)")
    return time.time() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--csv", type=Path)
    args = p.parse_args()
    rows = []
    for repeat in range(args.repeats):
        for together in (1, 2):
            for policy in POLICIES:
                seconds = timed(policy, together, args.steps)
                row = {"repeat": repeat, "policy": policy, "side_by_side": together, "seconds": round(seconds, 1)}
                rows.append(row)
                print(f"repeat {repeat}: {together} at once, OMP_WAIT_POLICY={policy}: {seconds:.1f} s", flush=True)
    mean = {
        (pol, n): sum(r["seconds"] for r in rows if (r["policy"], r["side_by_side"]) == (pol, n)) / args.repeats
        for pol in POLICIES
        for n in (1, 2)
    }
    summary = {
        "cores": os.cpu_count(),
        "steps": args.steps,
        "mean_seconds": {f"{pol.lower()}-{n}": round(v, 1) for (pol, n), v in mean.items()},
        **{
            f"{pol.lower()}_over_passive_{n}": round(mean[(pol, n)] / mean[("PASSIVE", n)], 2)
            for pol in POLICIES
            for n in (1, 2)
            if pol != "PASSIVE"
        },
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(bench_report({"summary": summary, "runs": rows}), indent=2) + "\n")
    if args.csv:
        with args.csv.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
