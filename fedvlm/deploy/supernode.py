"""A SuperNode that comes back after a crash.

    python -m fedvlm.deploy.supernode --pin <sha256> [--retry-for 600] [--idle-poll 0.5] -- \\
        <flower-supernode's arguments>

Flower's SuperLink takes a SuperNode for gone only once its heartbeats have stopped for a while
(about a minute); until then it refuses to activate another session with the same key. A
SuperNode restarted sooner (the machine rebooted quickly, a container restarted, a crashed
process was started again) is refused ("Failed to activate SuperNode", exit code 305), and
Flower's SuperNode exits instead of trying again, so the node stays out of the run.

This runs ``flower-supernode`` with the arguments given, passes its output through, and starts
it again, every ``--retry-every`` seconds, for as long as it ends with Flower's code 305 within
``--retry-for`` seconds of the first start; any other exit (a stop, a wrong argument, an
unregistered key after that window) ends it with the SuperNode's own exit status. SIGTERM and
SIGINT go to the SuperNode.

The SuperNode it runs is Flower's own, gated to the apps ``--pin`` names
(``fedvlm.deploy.supernode_gate``: any other app, and any run that is not a ClientApp's, is
refused before anything of it is stored or started), with its two hard-coded polling waits (3 s
between empty pulls, 0.5 s between looks for a reply) set by ``--idle-poll`` and ``--reply-poll``
(``fedvlm.deploy.supernode_polling``), and its wait for a ClientApp's reply bounded by
``--reply-timeout``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from fedvlm.deploy import supernode_polling

log = logging.getLogger("fedvlm.supernode")
# how Flower's SuperNode says it could not open its session: it exits with status 1 for every
# error and names its own code (305) on its output, which is read here on the way through
NOT_ACTIVATED = "Exit Code: 305"


def supervise(
    args: Sequence[str],
    pins: Sequence[str],
    retry_for: float,
    retry_every: float,
    idle_poll: float = 0.5,
    reply_poll: float = 0.1,
    reply_timeout: float = 3600.0,
) -> int:
    command = [
        sys.executable,
        "-m",
        "fedvlm.deploy.supernode_polling",
        *(f"--pin={pin}" for pin in pins),
        f"--idle-poll={idle_poll}",
        f"--reply-poll={reply_poll}",
        f"--reply-timeout={reply_timeout}",
        "--",
        *args,
    ]
    first = time.time()
    child: subprocess.Popen | None = None

    def forward(signum, frame) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert child.stdout is not None  # piped above
        refused = False
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            refused |= NOT_ACTIVATED in line
        code = child.wait()
        if not refused or time.time() - first > retry_for:
            return code
        log.warning(
            "the SuperLink did not activate this SuperNode (Flower's exit code 305; it still sees its previous "
            "session until that session's heartbeats time out): trying again in %.0f s",
            retry_every,
        )
        time.sleep(retry_every)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.supernode", description=__doc__.split("\n\n")[0])
    p.add_argument("--retry-for", type=float, default=600.0, help="seconds after the first start to keep trying")
    p.add_argument("--retry-every", type=float, default=5.0, help="seconds between tries")
    supernode_polling.add_arguments(p)
    p.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then flower-supernode's arguments")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rest = args.supernode_args[1:] if args.supernode_args[:1] == ["--"] else args.supernode_args
    return supervise(
        rest, args.pin, args.retry_for, args.retry_every, args.idle_poll, args.reply_poll, args.reply_timeout
    )


if __name__ == "__main__":
    sys.exit(main())
