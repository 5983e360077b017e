"""A node's warm worker (``client_app.worker``): start it beside the SuperNode, as the same user,
and name its socket in the SuperNode's node config.

    python -m fedvlm.deploy.node_worker --socket ~/fedvlm-node/worker/org-a.sock
    flower-supernode ... --node-config "... node-worker='/home/me/fedvlm-node/worker/org-a.sock'"

It imports torch and the project once at start, loads the backbone and the data at the node's
first message, and keeps them for the messages after. Stop it with SIGTERM or Ctrl-C; a
ClientApp that then finds no worker runs its messages itself.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fedvlm.client_app.worker import Worker, listen

log = logging.getLogger("fedvlm.node_worker")


def spawn(path: Path, log: Path, timeout: float = 120.0) -> subprocess.Popen:
    """Start a node worker on ``path`` as a process of its own (output to ``log``) and return it
    once it listens; a worker that exits or is not listening within ``timeout`` raises with its
    output."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedvlm.deploy.node_worker", "--socket", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.time() + timeout
    while not Path(path).exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"the node worker on {path} did not start:\n{Path(log).read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--socket", required=True, help="the socket path (its folder is made 0700)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = Path(args.socket).expanduser().resolve()
    server = listen(path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    import fedvlm.client_app.handlers  # noqa: F401 - torch and the project, once, before the first message

    log.info("node worker ready on %s", path)
    try:
        Worker().run(server)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
