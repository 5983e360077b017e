"""For bench/exchange_links.py only: every log line of a process started with this folder on its
PYTHONPATH begins with the wall-clock time to the millisecond, so that the logs of a federation's
programs (SuperNode, SuperExec, its ClientApps, node worker) can be laid on one time line."""

import logging
import time

_format = logging.Formatter.format


def _stamped(self: logging.Formatter, record: logging.LogRecord) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
    return f"@{stamp}.{int(record.msecs):03d} {_format(self, record)}"


logging.Formatter.format = _stamped  # type: ignore[method-assign]
