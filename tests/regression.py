"""Regression cases: every method on the embedded default, a few seeded rounds each, with and
without DP where it has a mechanism. ``tests/test_regression.py`` reruns them and compares every
per-round metric with ``tests/fixtures/regression.json``, so that a refactor which should not
change a number is shown not to.

    python tests/regression.py --write     # record the fixture (after a change that SHOULD move numbers)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "regression.json"

PROMPT = {"num-server-rounds": 2, "max-per-class": 6}
VLM = {
    "num-server-rounds": 2,
    "fraction-train": 0.5,
    "lora.local-steps": 2,
    "vlm.eval-samples": 3,
    "vlm.max-new-tokens": 8,
}
# the digits task on the 93 k-weight tiny source: fast (the motif source needs minutes of pretraining)
REPROGRAM = {"dataset": "digits", "num-server-rounds": 2, "reprogram.local-iterations": 2}

# name -> (run config, number of clients)
CASES: dict[str, tuple[dict, int]] = {
    "promptfl": ({"method": "promptfl", **PROMPT}, 4),
    "promptfl-dp": ({"method": "promptfl", "privacy.epsilon": 1.0, "prompt.local-steps": 2, **PROMPT}, 4),
    "coop": ({"method": "coop", **PROMPT}, 4),
    "zeroshot": ({"method": "zeroshot", **PROMPT}, 4),
    "dpfpl": ({"method": "dpfpl", **PROMPT}, 4),
    "dpfpl-dp": ({"method": "dpfpl", "privacy.epsilon": 1.0, **PROMPT}, 4),
    "fedotp-dp": ({"method": "fedotp", "privacy.epsilon": 1.0, **PROMPT}, 4),
    "fedpgp-dp": ({"method": "fedpgp", "privacy.epsilon": 1.0, **PROMPT}, 4),
    "pfedmoap": ({"method": "pfedmoap", "pfedmoap.k": 2, **PROMPT}, 4),
    "pfedmoap-dp": ({"method": "pfedmoap", "pfedmoap.k": 2, "privacy.epsilon": 1.0, **PROMPT}, 4),
    "fedrand": ({"method": "fedrand", **VLM}, 4),
    "fedrand-dp": ({"method": "fedrand", "privacy.epsilon": 4.0, **VLM}, 4),
    "fedavg-lora": ({"method": "fedavg-lora", **VLM}, 4),
    "fedper-lora": ({"method": "fedper-lora", **VLM}, 4),
    "fedpara-lora": ({"method": "fedpara-lora", **VLM}, 4),
    "reprogram": ({"method": "reprogram", **REPROGRAM}, 3),
    "bl-pf": ({"method": "bl-pf", **REPROGRAM}, 3),
    "bl-ff": ({"method": "bl-ff", **REPROGRAM}, 3),
    "bl-ts": ({"method": "bl-ts", **REPROGRAM}, 3),
}
VOLATILE = ("seconds",)  # wall-clock figures differ from run to run
# the packages whose versions can move a number; the fixture records them (its "_versions")
VERSIONED = (
    "torch",
    "torchvision",
    "numpy",
    "scipy",
    "scikit-learn",
    "pillow",
    "flwr",
    "open_clip_torch",
    "transformers",
    "tokenizers",
    "peft",
    "opacus",
    "dp-accounting",
)
VERSIONS_KEY = "_versions"
KERNELS_KEY = "by-kernels"


def kernels() -> str:
    """The family of CPU kernels these numbers come from: torch's dispatch level (AVX512, AVX2,
    ...), the CPU's vendor and the digest of a few seeded ops (matmul, conv, GELU, softmax, layer
    norm, exp, log, a sum). The same packages give other last bits on other kernels, and seeded
    training amplifies them into other accuracies within a round, so the fixture holds one record
    per family. The dispatch level alone is too coarse (measured: an AMD EPYC and CI's earlier
    AVX-512 machines both report AVX512 and differ in all 19 cases); the digest is the same with
    1 or 2 threads here, so it names the kernels, not the machine's load."""
    import hashlib

    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 512, generator=g), torch.randn(512, 256, generator=g)
    x, w = torch.randn(4, 3, 32, 32, generator=g), torch.randn(16, 3, 3, 3, generator=g)
    digest = hashlib.sha256()
    for out in (
        a @ b,
        F.conv2d(x, w, padding=1),
        F.gelu(a),
        a.softmax(-1),
        F.layer_norm(a, (512,)),
        a.exp(),
        a.abs().log1p(),
        a.sum(0),
    ):
        digest.update(out.contiguous().numpy().tobytes())
    return f"{torch.backends.cpu.get_cpu_capability()}/{_vendor()}/{digest.hexdigest()[:12]}"


def _vendor() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() or "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("vendor_id")), platform.machine())


def recorded(fixture: dict) -> dict[str, list[dict]] | None:
    """This machine's record in the fixture, or None when none was made on these kernels. A record
    keyed by the dispatch level alone was made before the key named the vendor and digest: it
    stands for a machine of that level whose full key has no record of its own."""
    records = fixture.get(KERNELS_KEY, {})
    key = kernels()
    return records.get(key, records.get(key.split("/")[0]))


def versions() -> dict[str, str]:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def changed_versions(recorded: dict[str, str]) -> list[str]:
    """The packages installed now at another version than when the fixture was recorded."""
    now = versions()
    return [f"{k} {recorded.get(k, '?')} -> {now[k]}" for k in VERSIONED if recorded.get(k) != now[k]]


def explain(diff: list[str], fixture: dict) -> str:
    """What differs, and whether the installed packages do: a fixture mismatch under other
    packages is a reinstall (pip install -c constraints.txt restores them), not a code change."""
    changed = changed_versions(fixture.get(VERSIONS_KEY, {}))
    if changed:
        why = f"installed packages differ from the fixture's: {', '.join(changed)} (install with -c constraints.txt)"
    elif kernels() not in fixture.get(KERNELS_KEY, {}):
        why = (
            f"the record compared is keyed by the dispatch level alone, and this machine's kernels "
            f"({kernels()}) may not be the ones it was made on: the code changed a number, or these kernels "
            "need their own record (python tests/regression.py --write on a commit that passed elsewhere)"
        )
    else:
        why = "the installed packages and CPU kernels are the fixture's: the code changed a number"
    return "; ".join(diff[:8]) + f". {why}"


def run_case(name: str, cache_dir: Path, out_dir: Path) -> list[dict[str, float]]:
    """The case's per-round metrics (wall-clock figures left out)."""
    from fedvlm.client_app.app import app as client_app
    from fedvlm.methods.validation import validate
    from fedvlm.server_app.app import execute
    from fedvlm.utils.inprocess import InProcessGrid, ensure_task_identity

    ensure_task_identity()
    raw, n = CASES[name]
    cfg = validate({**raw, "cache-dir": str(cache_dir), "output-dir": str(out_dir), "run-name": name})
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], cfg.as_dict())
    rounds = execute(cfg, grid, run_id=name).data["rounds"]
    return [
        {k: v for k, v in r["metrics"].items() if not any(t in k for t in VOLATILE) and isinstance(v, (int, float))}
        for r in rounds
    ]


def differences(expected: list[dict], got: list[dict], rel: float = 1e-5, abs_: float = 1e-7) -> list[str]:
    """What differs from the record: a number, a round, or a figure the record has and this run
    lacks (or the other way round in one round). A figure no round of the record has is one added
    since it was recorded on these kernels: it moves no recorded number, and is pinned once the
    record is made again here (``--write``); the other machines' records cannot be made here."""
    out = []
    if len(expected) != len(got):
        return [f"{len(got)} rounds, expected {len(expected)}"]
    known = set().union(*expected) if expected else set()
    for i, (e, g) in enumerate(zip(expected, got, strict=True), start=1):
        for k in sorted(set(e) | (set(g) & known)):
            if k not in e or k not in g:
                out.append(f"round {i}: {k} only in {'the fixture' if k in e else 'this run'}")
            elif not (math.isclose(e[k], g[k], rel_tol=rel, abs_tol=abs_) or (math.isnan(e[k]) and math.isnan(g[k]))):
                out.append(f"round {i}: {k} = {g[k]!r}, fixture {e[k]!r}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="record the fixture instead of comparing")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--cache-dir", default="", help="cache of the embedded models (default: a temporary one)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp())
    fixture = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    if args.write and changed_versions(fixture.get(VERSIONS_KEY, {})):
        fixture = {}  # records under other packages no longer say what these packages give
    mine = fixture.setdefault(KERNELS_KEY, {}).setdefault(kernels(), {})
    failed = False
    for name in args.cases.split(","):
        got = run_case(name, cache, Path(tempfile.mkdtemp()))
        if args.write:
            mine[name] = got
            print(f"{name}: recorded {len(got)} rounds on {kernels()} kernels", flush=True)
        else:
            diff = differences(mine.get(name, []), got)
            failed |= bool(diff)
            print(f"{name}: {'OK' if not diff else explain(diff, fixture)}", flush=True)
    if args.write:
        fixture[VERSIONS_KEY] = versions()
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
