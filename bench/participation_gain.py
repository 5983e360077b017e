"""Where one method's lead over another comes from: each client's figure (the mean of its last
10 rounds) in two sweeps' runs of the same seeds, grouped by how many rounds the client trained,
the difference per group with its standard error over client-seeds.

Both runs of a seed sample the same clients (the sampling is seeded by the run's seed, not its
method; the script checks it), so a group holds the same clients in both.

A private run's audited node trains on its records and the audit's canaries, so it runs more
local steps than the same node without noise; ``--audited-apart`` reports the lead over the other
nodes alone (compute matched), per seed, with its 95% interval over seeds, and the audited node as
its own group. ``A@EPS`` compares rows at a privacy level ('none' without one); ``--final`` reads
the last round, as pFedMoAP's Table 6 does.

    python bench/participation_gain.py docs/results/protocol-runs/clients-100 pfedmoap promptfl --seeds 0,1,2,3,4
    python bench/participation_gain.py docs/results/protocol-runs/paper-pfedmoap pfedmoap@none pfedmoap@50 \
        --seeds 0,1,2,3,4 --final --audited-apart
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from fedvlm.experiments import stats
from fedvlm.experiments.sweep import run_name
from fedvlm.utils.files import read_results

FIGURE = "eval/local-acc"
AUDITED = "train/audit-canaries"  # a node's round record holds it where that node trained the audit's canaries
APART = -1  # the group of audited nodes


def per_client(run: Path, last: int = 10) -> tuple[dict[str, float], Counter, set[str]]:
    """Each client's figure (mean of its ``last`` rounds), how many rounds it trained, and the
    nodes that trained the audit's canaries."""
    rounds = read_results(run, "run the sweep again with the same --out")["rounds"]
    trained: Counter = Counter()
    audited: set[str] = set()
    for r in rounds:
        trained.update(c for c, v in r.get("clients", {}).items() if "train/num-examples" in v)
        audited |= {c for c, v in r.get("clients", {}).items() if v.get(AUDITED)}
    seen: dict[str, list[float]] = defaultdict(list)
    for r in rounds[-last:]:
        for c, v in r.get("clients", {}).items():
            if FIGURE in v:
                seen[c].append(float(v[FIGURE]))
    return {c: float(np.mean(a)) for c, a in seen.items()}, trained, audited


def _row(label: str) -> tuple[str, str]:
    variant, _, eps = label.partition("@")
    return variant, eps or "none"


def gains(folder: Path, better: str, worse: str, seeds: list[int], cap: int, last: int = 10, apart: bool = False):
    groups: dict[int, list[float]] = defaultdict(list)
    others: dict[int, float] = {}  # seed -> mean difference over the nodes no run audited
    for seed in seeds:
        a, trained, audited = per_client(folder / "runs" / run_name(*_row(better), seed), last)
        b, trained_b, audited_b = per_client(folder / "runs" / run_name(*_row(worse), seed), last)
        if trained != trained_b:
            raise SystemExit(f"seed {seed}: the two runs trained different clients; their groups would differ")
        both = sorted(a.keys() & b.keys())
        for client in both:
            audit = apart and client in audited | audited_b
            groups[APART if audit else min(trained[client], cap)].append(100 * (a[client] - b[client]))
        rest = [100 * (a[c] - b[c]) for c in both if c not in audited | audited_b]
        others[seed] = float(np.mean(rest)) if rest else float("nan")
    rows = []
    for k in sorted(groups):
        v = np.array(groups[k])
        se = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None
        rows.append(
            {
                "trained": "audited" if k == APART else f"{k}+" if k == cap else str(k),
                "client_seeds": len(v),
                "difference": float(v.mean()),
                "se": se,
            }
        )
    every = np.concatenate([np.array(g) for g in groups.values()])
    found = {
        "folder": str(folder),
        "better": better,
        "worse": worse,
        "seeds": seeds,
        "rounds_averaged": last,
        "overall": float(every.mean()),
        "groups": rows,
    }
    unaudited = stats.spread(others.values())
    if apart and unaudited is not None:
        found["unaudited"] = {"per_seed": others, "mean": unaudited.mean, "ci95": [unaudited.low, unaudited.high]}
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a sweep's --out (its runs/ holds both variants' runs)")
    p.add_argument("better")
    p.add_argument("worse")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--cap", type=int, default=3, help="clients trained this many times or more form one group")
    p.add_argument("--final", action="store_true", help="the last round's figure, not the mean of the last 10")
    p.add_argument("--audited-apart", action="store_true", help="the audited node as its own group")
    p.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    found = gains(args.folder, args.better, args.worse, seeds, args.cap, 1 if args.final else 10, args.audited_apart)
    print(f"{args.better} - {args.worse}, local accuracy (points), {args.folder}: overall {found['overall']:+.2f}")
    for g in found["groups"]:
        se = f" (se {g['se']:.2f})" if g["se"] is not None else ""
        print(f"  trained {g['trained']:>7}: {g['client_seeds']:4d} client-seeds, {g['difference']:+.2f}{se}")
    if "unaudited" in found:
        u = found["unaudited"]
        low, high = u["ci95"]
        print(
            f"  every node but the audited one, per seed: {u['mean']:+.2f} [{low:+.2f}, {high:+.2f}] (95% t interval)"
        )
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
