"""Checks on every client reply before the server uses it.

A reply is used only if it carries exactly the tensors the server expects from that node
this round, with the expected shapes, a floating dtype and finite values, plus a positive
integer ``num-examples``. Anything else raises ``ReplyRejected`` with the reason; the
strategy drops that reply, logs and records the reason, and the round goes on."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, Message


class ReplyRejected(ValueError):
    pass


def record_nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Payload size: the bytes of the tensors themselves (not protocol framing)."""
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


def check_reply(
    msg: Message, expected: Mapping[str, tuple[int, ...]], need_examples: bool = True
) -> tuple[dict[str, np.ndarray], dict]:
    if msg.has_error():
        raise ReplyRejected(f"the client failed: {short_reason(msg.error.reason)}")
    content = msg.content
    arrays: dict[str, np.ndarray] = {}
    if "arrays" in content:
        record = content["arrays"]
        if not isinstance(record, ArrayRecord):
            raise ReplyRejected(f"'arrays' is a {type(record).__name__}, expected an ArrayRecord")
        arrays = {k: v.numpy() for k, v in record.items()}
    missing = set(expected) - set(arrays)
    extra = set(arrays) - set(expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(sorted(missing))}")
        if extra:
            parts.append(f"unexpected {', '.join(sorted(extra))}")
        raise ReplyRejected("wrong tensors: " + "; ".join(parts))
    for name, shape in expected.items():
        a = arrays[name]
        if tuple(a.shape) != tuple(shape):
            raise ReplyRejected(f"tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        if not np.issubdtype(a.dtype, np.floating):
            raise ReplyRejected(f"tensor {name!r} has dtype {a.dtype}, expected a floating type")
        if not np.isfinite(a).all():
            raise ReplyRejected(f"tensor {name!r} holds {int((~np.isfinite(a)).sum())} NaN/Inf values")
    metrics = dict(content["metrics"]) if "metrics" in content else {}
    for k, v in metrics.items():
        if isinstance(v, float) and not np.isfinite(v):
            raise ReplyRejected(f"metric {k!r} is {v}")
    if need_examples:
        n = metrics.get("num-examples")
        if not isinstance(n, int) or n <= 0:
            raise ReplyRejected(f"metric 'num-examples' must be a positive integer, got {n!r}")
    return arrays, metrics


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.+)$")


def short_reason(reason: str | None) -> str:
    """The useful line of a client's error. Flower passes whole tracebacks (wrapped by Ray
    in simulation); keep the last ``SomeError: message`` line of the original exception."""
    lines = [ln.strip() for ln in (reason or "").strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = _EXC_LINE.match(ln)
        if m and not m.group(1).endswith("ClientAppException"):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}".rstrip("'>")
    return lines[-1][-500:] if lines else "unknown error"
