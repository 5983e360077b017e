"""Run docs/deployment.md's Docker block ("Run it") as written, line by line, in a fresh checkout:
what an operator types, echoed as it runs (``set -x``), stopping at the first failing line.

    python bench/walk_docker_docs.py --checkout ~/fedvlm [--sudo-container]

Run it as the non-root account the docs address (in the ``docker`` group). ``--sudo-container``
stands in for ``sudo`` where the machine has none: each ``sudo`` line runs in a root container of
the image the block just built, on the checkout's ``docker/`` folder, which an account in the
``docker`` group can do anyway. Tear the federation down afterwards with
``docker-compose -p fedvlm down -v`` in ``docker/``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"
SUDO_CONTAINER = 'sudo() { docker run --rm -u 0 -v "$PWD:$PWD" -w "$PWD" --entrypoint "$1" fedvlm:latest "${@:2}"; }\n'


def block(docs: Path = DOCS) -> str:
    """The bash block under "**Run it**" in the Docker section."""
    return docs.read_text().split("**Run it**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", type=Path, required=True, help="a fresh checkout of this repository")
    p.add_argument("--sudo-container", action="store_true", help="run `sudo` lines in a root container")
    args = p.parse_args()
    script = "set -e -o pipefail\n" + (SUDO_CONTAINER if args.sudo_container else "")
    script += f"cd {str(args.checkout.expanduser().resolve())!r}\nset -x\n" + block()
    return subprocess.run(["bash", "-c", script]).returncode


if __name__ == "__main__":
    sys.exit(main())
