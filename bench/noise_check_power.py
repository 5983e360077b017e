"""What the per-step noise check catches, per method: every noised tensor each private method
releases on the embedded default (one real round in-process, the noise check observed as it
runs; two rounds), its coordinates, and the noise scale factors that ``privacy.dpsgd.check_noise`` refuses
with probability 0.99 in one step (``detectable_scale``: below the first, or above the second).

    python -m bench.noise_check_power --json docs/results/noise_check_power.json \
        --csv docs/results/noise_check_power.csv

A prompt's tensor scales with the CLIP width (ViT-B/16: 16 x 512 = 8,192 coordinates; the
embedded tiny CLIP: 16 x 96); the sizes printed are the embedded default's, and the last row
adds ViT-B/16's prompt for reference. Slow to run (two rounds per method, the tiny VLM pretrained
at first use: minutes).
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
from pathlib import Path

from bench.measure import bench_report

# the private regression cases (tests/regression.py): the smallest config that shows each mechanism
CASES = ("promptfl-dp", "dpfpl-dp", "fedotp-dp", "fedpgp-dp", "pfedmoap-dp", "fedrand-dp", "reprogram", "bl-pf")


def observe(case: str, cache: Path, out: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """{(where, tensor): (coordinates, tensors checked together)} over the case's rounds (two:
    pFedMoAP's gate trains from a node's second round, when it has experts)."""
    from fedvlm.privacy import budget, dpsgd
    from tests.regression import run_case  # run from the checkout's root, as a module

    seen: dict[tuple[str, str], tuple[int, int]] = {}
    honest = dpsgd.check_noise

    def watching(added, sigma, what="this step"):
        tests = sum(1 for a in added.values() if a.numel())
        for name, a in added.items():
            seen[(what, name)] = (a.numel(), tests)
        return honest(added, sigma, what)

    dpsgd.check_noise, budget.check_noise = watching, watching
    try:
        run_case(case, cache, out)
    finally:
        dpsgd.check_noise, budget.check_noise = honest, honest
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--cache-dir", default="", help="cache of the embedded models (default: a temporary one)")
    p.add_argument("--json", type=Path)
    p.add_argument("--csv", type=Path)
    args = p.parse_args()
    from fedvlm.privacy.noise_check import NOISE_SIGNIFICANCE, detectable_scale

    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp())
    rows = []
    for case in args.cases.split(","):
        print(f"{case}: its private rounds ...", flush=True)
        for (where, name), (dof, tests) in sorted(observe(case, cache, Path(tempfile.mkdtemp())).items()):
            below, above = detectable_scale(dof, tests)
            rows.append(
                {"case": case, "where": where, "tensor": name, "coordinates": dof, "tested-with": tests}
                | {"refused-at-or-below": round(below, 4), "refused-at-or-above": round(above, 4)}
            )
    below, above = detectable_scale(16 * 512, 1)
    rows.append(
        {"case": "ViT-B/16 prompt (reference)", "where": "this step", "tensor": "ctx", "coordinates": 16 * 512}
        | {"tested-with": 1, "refused-at-or-below": round(below, 4), "refused-at-or-above": round(above, 4)}
    )
    width = max(len(r["case"]) for r in rows)
    print(f"\nper-step noise check at significance {NOISE_SIGNIFICANCE:g}, refusal probability >= 0.99 when the noise")
    print(f"{'case':<{width}}  {'where':<20} {'tensor':<28} {'coords':>8} {'of':>3} {'x <=':>7} {'x >=':>8}")
    for r in rows:
        print(
            f"{r['case']:<{width}}  {r['where']:<20} {r['tensor']:<28} {r['coordinates']:>8,} {r['tested-with']:>3} "
            f"{r['refused-at-or-below']:>7.3f} {r['refused-at-or-above']:>8.3f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(bench_report({"significance": NOISE_SIGNIFICANCE, "power": 0.99, "rows": rows}), indent=1)
        )
    if args.csv:
        with args.csv.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
