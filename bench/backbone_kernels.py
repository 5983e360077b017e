"""Which float kernels decide the embedded backbone: the embedded CLIP pretrained once per kernel
setting on this CPU, each in a fresh process, and the fingerprint of the weights each gives, set
beside the weights the published runs started from (and the CPU each was made on).

The embedded default is pretrained on the machine that first needs it (``models.tiny_clip``), and
an AMD EPYC and an Intel Xeon gave two sets of weights (docs/results/experiments.md, "Two
backbones"). PyTorch, MKL and oneDNN each let one cap the instruction set their kernels use by an
environment variable; the thread count sets how reductions split, so the loader pretrains on a
pinned count (``models.prepare.PRETRAIN_THREADS``), which the one-thread setting checks. This asks
whether a cap makes this CPU give another CPU's weights, that is whether one setting would make the
backbone the same on every machine.

    python bench/backbone_kernels.py --runs docs/results --out docs/results/backbone-kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from fedvlm.models.tiny_clip import EMBEDDED_MODEL_NAME
from fedvlm.server_app.results import host
from fedvlm.utils.files import RESULTS, atomic_write_json, read_results

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl-avx2": {"MKL_CBWR": "AVX2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "all-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "one-thread": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
}

# run in the child: pretrain with the recipe every run uses, as the loader does, print what the weights are
CHILD = """
import json, time, torch
from fedvlm.models import tiny_clip
from fedvlm.models.clip_loader import GELU, weights_fingerprint
from fedvlm.models.prepare import pretraining
t = time.time()
with pretraining("prompt", tiny_clip.EMBEDDED_MODEL_NAME):  # as the loader pretrains: threads pinned
    model = tiny_clip.pretrain(progress=False)
    threads = torch.get_num_threads()
print(json.dumps({"fingerprint": weights_fingerprint(tiny_clip.EMBEDDED_MODEL_NAME, model, GELU),
                  "capability": torch.backends.cpu.get_cpu_capability(), "threads": threads,
                  "seconds": round(time.time() - t, 1)}))
"""


def published(root: Path) -> dict[str, Counter]:
    """Each embedded CLIP fingerprint the runs under ``root`` recorded: the CPUs its runs were made on."""
    found: dict[str, Counter] = {}
    for path in root.rglob(RESULTS):
        run = read_results(path.parent, "move it away, or point --runs elsewhere")["run"]
        fp = str((run.get("backbone") or {}).get("fingerprint"))
        if fp.startswith(EMBEDDED_MODEL_NAME + ":"):
            found.setdefault(fp, Counter())[(run.get("host") or {}).get("cpu", "?")] += 1
    return found


def pretrain_under(env: dict[str, str]) -> dict:
    """Pretrain in a fresh process (the variables are read when the libraries load)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, default=Path("docs/results"), help="where the published runs are")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    args = p.parse_args()
    unknown = sorted(set(args.settings.split(",")) - SETTINGS.keys())
    if unknown:
        p.error(f"--settings: {', '.join(unknown)} unknown; name some of {', '.join(SETTINGS)}")
    known = published(args.runs)
    report = {
        "host": host(),
        "command": "python " + " ".join(sys.argv),
        "published backbones": {fp: dict(cpus) for fp, cpus in known.items()},
        "settings": [],
    }
    for name in args.settings.split(","):
        t0 = time.time()
        got = {"setting": name, "env": SETTINGS[name], **pretrain_under(SETTINGS[name])}
        got["published runs on these weights"] = dict(known.get(got["fingerprint"], {}))
        report["settings"].append(got)
        print(json.dumps(got), f"({time.time() - t0:.0f} s)", flush=True)
        if args.out:  # after each setting: a child that fails later loses none of those before it
            atomic_write_json(report, args.out)


if __name__ == "__main__":
    main()
