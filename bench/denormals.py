"""What denormal floats cost on this CPU, and whether the project's flush (``utils.floats``) is on
in a fresh process: the kernels a DP-SGD step runs, timed on denormal inputs and on normal ones
(the control), once with denormals flushed and once kept (``FEDVLM_FLUSH_DENORMALS=0``), each
mode in its own fresh process because the mode is fixed when the compute threads start. With
``--pretrain``, the embedded CLIP is also pretrained in each mode: the weights' fingerprint says
whether flushing changes them.

    python bench/denormals.py --repeats 3 --pretrain --out docs/results/denormals.json

Printed: per kernel and input, the median seconds of each mode and kept / flushed, over the
repeats (fresh processes alternating between the modes, so a load change hits both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.measure import bench_report
from fedvlm.utils.files import atomic_write_json
from fedvlm.utils.floats import ENV

MODES = {"flushed": "1", "kept": "0"}

# run in the child: the project's own call sets the mode, then each kernel is timed on inputs of
# one kind (float32 denormals, below 1.18e-38; normal floats of about 1e-3)
CHILD = """
import json, sys, time, torch
from fedvlm.utils.floats import compute_report, flush_denormals
flush_denormals()
def timed(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2]
def inputs(shape, denormal, g):
    # denormals made from their bits: float arithmetic on a flushing thread would zero them
    if denormal:
        return torch.randint(1, 1 << 23, shape, generator=g, dtype=torch.int32).view(torch.float32)
    return torch.rand(shape, generator=g) * 1e-3
rows = {}
for name in ("denormal", "normal"):
    g = torch.Generator().manual_seed(0)
    x = inputs((1 << 22,), name == "denormal", g)
    m = inputs((512, 512), name == "denormal", g)
    v, y, mo = torch.zeros(1 << 22), torch.empty(1 << 22), torch.empty(512, 512)  # no allocation is timed
    rows[name] = {
        "multiply-add (4M)": timed(lambda: torch.add(x, x, alpha=0.9, out=y)),
        "adam moment update (4M)": timed(lambda: v.mul_(0.999).addcmul_(x, x, value=0.001)),
        "matmul (512x512)": timed(lambda: torch.mm(m, m, out=mo)),
        "norm (4M)": timed(lambda: torch.linalg.vector_norm(x)),
    }
out = {"compute": compute_report(), "seconds": rows}
if sys.argv[1:] == ["pretrain"]:
    from fedvlm.models import tiny_clip
    from fedvlm.models.clip_loader import GELU, weights_fingerprint
    t = time.time()
    model = tiny_clip.pretrain(progress=False)
    out["pretrain"] = {"fingerprint": weights_fingerprint(tiny_clip.EMBEDDED_MODEL_NAME, model, GELU),
                       "seconds": round(time.time() - t, 1)}
print(json.dumps(out))
"""


def run_mode(mode: str, pretrain: bool) -> dict:
    """One fresh process in ``mode``: its compute report, kernel seconds and (optionally) weights."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *(["pretrain"] if pretrain else [])],
        env={**os.environ, ENV: MODES[mode]},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: dict[str, list[dict]]) -> list[dict]:
    """Per input and kernel: each mode's median over the repeats, and kept / flushed."""
    rows = []
    first = runs["flushed"][0]["seconds"]
    for inputs, kernels in first.items():
        for kernel in kernels:
            median = {m: statistics.median(r["seconds"][inputs][kernel] for r in runs[m]) for m in MODES}
            rows.append(
                {
                    "inputs": inputs,
                    "kernel": kernel,
                    **{f"{m} s": round(s, 6) for m, s in median.items()},
                    "kept / flushed": round(median["kept"] / median["flushed"], 2),
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per mode")
    p.add_argument(
        "--pretrain", action="store_true", help="also pretrain the embedded CLIP in each mode (first repeat)"
    )
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(args.repeats):
        for mode in MODES:
            runs[mode].append(run_mode(mode, args.pretrain and i == 0))
            print(f"repeat {i + 1}/{args.repeats}, {mode}: {runs[mode][-1]['compute']}", flush=True)
    rows = summary(runs)
    for r in rows:
        print(
            f"{r['inputs']:>8} {r['kernel']:<24} flushed {r['flushed s']:.5f} s  kept {r['kept s']:.5f} s  "
            f"kept/flushed {r['kept / flushed']:.2f}x"
        )
    report = {
        "command": "python bench/denormals.py " + " ".join(sys.argv[1:]),
        "compute": {m: sorted({r["compute"] for r in runs[m]}) for m in MODES},
        "kernels": rows,
        "pretrain": {m: runs[m][0]["pretrain"] for m in MODES if "pretrain" in runs[m][0]},
    }
    for mode, weights in report["pretrain"].items():
        print(f"pretrained ({mode}): {weights['fingerprint']} in {weights['seconds']} s")
    if args.out:
        atomic_write_json(bench_report(report), args.out)


if __name__ == "__main__":
    main()
