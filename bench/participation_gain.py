"""Where one method's lead over another comes from: each client's figure (the mean of its last
10 rounds) in two sweeps' runs of the same seeds, grouped by how many rounds the client trained,
the difference per group with its standard error over client-seeds.

Both runs of a seed sample the same clients (the sampling is seeded by the run's seed, not its
method; the script checks it), so a group holds the same clients in both.

    python bench/participation_gain.py docs/results/protocol-runs/clients-100 pfedmoap promptfl --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from fedvlm.experiments.sweep import run_name
from fedvlm.utils.files import read_results

FIGURE = "eval/local-acc"


def per_client(run: Path) -> tuple[dict[str, float], Counter]:
    """Each client's figure, mean of the last 10 rounds, and how many rounds it trained."""
    rounds = read_results(run, "run the sweep again with the same --out")["rounds"]
    trained: Counter = Counter()
    for r in rounds:
        trained.update(c for c, v in r.get("clients", {}).items() if "train/num-examples" in v)
    seen: dict[str, list[float]] = defaultdict(list)
    for r in rounds[-10:]:
        for c, v in r.get("clients", {}).items():
            if FIGURE in v:
                seen[c].append(float(v[FIGURE]))
    return {c: float(np.mean(a)) for c, a in seen.items()}, trained


def gains(folder: Path, better: str, worse: str, seeds: list[int], cap: int) -> dict:
    groups: dict[int, list[float]] = defaultdict(list)
    for seed in seeds:
        a, trained = per_client(folder / "runs" / run_name(better, "none", seed))
        b, trained_b = per_client(folder / "runs" / run_name(worse, "none", seed))
        if trained != trained_b:
            raise SystemExit(f"seed {seed}: the two runs trained different clients; their groups would differ")
        for client in a.keys() & b.keys():
            groups[min(trained[client], cap)].append(100 * (a[client] - b[client]))
    rows = []
    for k in sorted(groups):
        v = np.array(groups[k])
        se = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None
        rows.append(
            {
                "trained": f"{k}+" if k == cap else str(k),
                "client_seeds": len(v),
                "difference": float(v.mean()),
                "se": se,
            }
        )
    every = np.concatenate([np.array(g) for g in groups.values()])
    return {
        "folder": str(folder),
        "better": better,
        "worse": worse,
        "seeds": seeds,
        "overall": float(every.mean()),
        "groups": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a sweep's --out (its runs/ holds both variants' runs)")
    p.add_argument("better")
    p.add_argument("worse")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--cap", type=int, default=3, help="clients trained this many times or more form one group")
    p.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = p.parse_args(argv)
    found = gains(args.folder, args.better, args.worse, [int(s) for s in args.seeds.split(",")], args.cap)
    print(f"{args.better} - {args.worse}, local accuracy (points), {args.folder}: overall {found['overall']:+.2f}")
    for g in found["groups"]:
        se = f" (se {g['se']:.2f})" if g["se"] is not None else ""
        print(f"  trained {g['trained']:>2} rounds: {g['client_seeds']:4d} client-seeds, {g['difference']:+.2f}{se}")
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
