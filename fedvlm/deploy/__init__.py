"""What an organisation and a researcher run to deploy: credentials, the local TLS federation,
the SuperNode and SuperExec wrappers, the node worker, the Fleet gateway, demo data folders."""

from __future__ import annotations

import logging


def log_beside_flower() -> None:
    """fedvlm's own log lines on stderr, in a process that runs a Flower command in-process.
    Flower's logger has its own handler and also propagates to the root logger: configuring the
    root logger (``logging.basicConfig``) would print each of Flower's lines twice."""
    logger = logging.getLogger("fedvlm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
