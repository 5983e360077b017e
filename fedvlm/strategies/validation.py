"""Checks on every client reply before the server uses it.

A reply is used only if it carries exactly the tensors the server expects from that node
this round, with the expected shapes, float32 (what every shared tensor travels as) and
finite values; metrics in a MetricRecord, each a finite number; and, for training, an integer
``num-examples`` between 1 and the training records the node reported in its handshake (a
client cannot claim more weight than its data). Anything else raises ``ReplyRejected`` with
the reason; the strategy drops that reply, logs and records the reason, and the round goes on.

``bound_norms`` then bounds the round's updates (``replies.*`` run keys): a hostile client can
send finite, well-shaped tensors of any size, so an update whose norm exceeds the bound is
clipped to it or rejected, and the choice is recorded."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord


class ReplyRejected(ValueError):
    pass


def record_nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Payload size: the bytes of the tensors themselves (not protocol framing)."""
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


def check_reply(
    msg: Message, expected: Mapping[str, tuple[int, ...]], need_examples: bool = True, max_examples: int = 0
) -> tuple[dict[str, np.ndarray], dict]:
    """The reply's arrays and metrics, or ``ReplyRejected``; ``max_examples`` (> 0): the most
    ``num-examples`` the node may claim."""
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
        if a.dtype != np.float32:
            raise ReplyRejected(f"tensor {name!r} has dtype {a.dtype}, expected float32")
        if not np.isfinite(a).all():
            raise ReplyRejected(f"tensor {name!r} holds {int((~np.isfinite(a)).sum())} NaN/Inf values")
    metrics: dict = {}
    if "metrics" in content:
        record = content["metrics"]
        if not isinstance(record, MetricRecord):
            raise ReplyRejected(f"'metrics' is a {type(record).__name__}, expected a MetricRecord")
        metrics = dict(record)
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise ReplyRejected(f"metric {k!r} is {v!r}, expected a finite number")
    if need_examples:
        n = metrics.get("num-examples")
        if not isinstance(n, int) or n <= 0:
            raise ReplyRejected(f"metric 'num-examples' must be a positive integer, got {n!r}")
        if max_examples and n > max_examples:
            raise ReplyRejected(
                f"it claims num-examples = {n}, more than the {max_examples} training records it reported"
            )
    return arrays, metrics


def update_norm(sent: Mapping[str, np.ndarray], reply: Mapping[str, np.ndarray]) -> float:
    """L2 norm (float64) of what ``reply`` changes: each tensor minus the one sent, a tensor the
    node was not sent (a gradient) as it is."""
    total = 0.0
    for name, value in reply.items():
        delta = np.asarray(value, np.float64)
        if name in sent:
            delta = delta - np.asarray(sent[name], np.float64)
        total += float(np.sum(delta * delta))
    return float(np.sqrt(total))


def clipped(sent: Mapping[str, np.ndarray], reply: Mapping[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    """``reply`` with its update scaled by ``factor``."""
    out = {}
    for name, value in reply.items():
        base = np.asarray(sent[name], np.float64) if name in sent else 0.0
        out[name] = (base + (np.asarray(value, np.float64) - base) * factor).astype(value.dtype)
    return out


def norm_bound(norms: list[float], ratio: float, absolute: float) -> float:
    """The round's bound: ``ratio`` times the lower median of ``norms`` (unset while that median
    is 0) and ``absolute``, whichever is smaller; inf for none."""
    bounds = [absolute] if absolute > 0 else []
    if ratio > 0 and norms:
        median = sorted(norms)[(len(norms) - 1) // 2]
        if median > 0:
            bounds.append(ratio * median)
    return min(bounds, default=float("inf"))


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
