"""Download, here, the wheels a GPU machine lacks for ``bench/gpu_check.sh``: every package the
project needs at run time (its dependencies in pyproject.toml and theirs, as installed here), at
the lock's version (``constraints.txt``), that the machine's image does not already hold, for its
Python (3.12, manylinux x86-64), into ``.whl/`` (which ``.git/info/exclude`` should ignore; the device tool
carries it). The image's own PyTorch, CUDA libraries and scientific stack are used as they are;
Ray is left out (its wheel alone is larger than what may travel), so the GPU check runs the
in-process engine only.

    python bench/gpu_wheels.py --have bench/gpu_image_packages.txt      # then carry .whl

``--have``: the package names the image holds, one per line (the device library's KINDS.md lists
them; ``python3 -m pip list --format freeze`` there gives them exactly).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# never carried: the image's own torch stack, and what is too large to travel and unused by the
# check (Ray: its wheel alone; pycocoevalcap: 104 MB of Java for the VLM family's caption metrics)
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|ray|uv|pyarrow|jax.*|pycocoevalcap|pycocotools)$")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> set[str]:
    """The run-time dependencies of ``roots`` and theirs, as this environment has them installed
    (no extras, markers evaluated here)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or NEVER.match(name):
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        for line in reqs:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(norm(req.name))
    return seen


def wanted(lock: Path, have: set[str]) -> list[str]:
    """The lock's pins of the project's run-time closure that the image lacks."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = closure([re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] for d in project["dependencies"]])
    pins = [line.strip() for line in lock.read_text().splitlines() if "==" in line and not line.startswith("#")]
    return [p for p in pins if (name := norm(p.split("==")[0])) in needed and name not in have]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--have", type=Path, required=True, help="the image's package names, one per line")
    p.add_argument("--dest", type=Path, default=ROOT / ".whl")
    args = p.parse_args()
    lines = [line.strip() for line in args.have.read_text().splitlines() if line.strip() and not line.startswith("#")]
    have = {norm(line.split("==")[0]) for line in lines}
    pins = wanted(ROOT / "constraints.txt", have)
    args.dest.mkdir(exist_ok=True)
    for pin in pins:
        base = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(args.dest), pin]
        binary = [*base, "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        binary += [arg for plat in PLATFORMS for arg in ("--platform", plat)]
        if subprocess.run(binary).returncode:  # a pure-Python package published as a source archive only
            subprocess.run([*base, "--no-binary=:all:"], check=True)
    size = sum(f.stat().st_size for f in args.dest.iterdir()) / 2**20
    print(f"{len(pins)} packages in {args.dest}: {size:.1f} MiB (a device call carries at most 64 MiB with the tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
