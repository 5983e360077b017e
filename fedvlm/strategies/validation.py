"""Checks on every client reply before the server uses it.

A reply is used only if it carries exactly the tensors the server expects from that node
this round, with the expected shapes, float32 (what every shared tensor travels as) and
finite values; metrics in a MetricRecord, each a finite number; and, for training, an integer
``num-examples`` between 1 and the training records the node reported in its handshake (a
client cannot claim more weight than its data). Anything else raises ``ReplyRejected`` with
the reason; the strategy drops that reply, logs and records the reason, and the round goes on.

``bound_round`` then bounds the round's updates: a hostile client can send finite, well-shaped
tensors of any size, so an update whose norm exceeds its bound is clipped to it or rejected, and
the choice is recorded. Two rules, each on its own part of an update (``ReplyBound``):

- the tensors the server noises (global DP: DP-FPL's family's clipped global-prompt gradient)
  are bounded at a fixed norm, the privacy clip C. An honest client clips that upload to C
  itself, so the bound never binds for it; clipping to a fixed ball is a projection (it moves
  two uploads no further apart), and a fixed rejection rule no honest upload can meet is never
  applied to one. Nothing in it depends on another client's reply, so one record still moves
  the pre-noise average by at most C / (N B), the sensitivity the ledger accounts;
- every other tensor is bounded by ``replies.norm-ratio`` times the round's lower median of
  those norms and ``replies.max-norm``. The median depends on every client's data, so this rule
  may only see uploads that are already noised by their sender (local DP: it is then
  post-processing) or that no DP guarantee covers (privacy off)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from fedvlm.runconfig.schema import RepliesConfig


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


# float32 rounding of an honest client's own clip to C: a norm this close to a fixed bound is
# within it (a rejection of an honest upload would be data-dependent; see the module docstring)
FIXED_SLACK = 1e-5


@dataclass(frozen=True)
class ReplyBound:
    """How one part of every update is bounded: ``tensors`` at a ``fixed`` norm (data-independent),
    or, with ``tensors`` None, every tensor no fixed rule holds, at the round's relative bound."""

    rule: str  # what the ledger and the round record call it
    why: str  # why it keeps the stated guarantee
    tensors: frozenset[str] | None = None
    fixed: float = 0.0

    def part(self, arrays: Mapping[str, np.ndarray], others: frozenset[str]) -> dict[str, np.ndarray]:
        if self.tensors is not None:
            return {k: v for k, v in arrays.items() if k in self.tensors}
        return {k: v for k, v in arrays.items() if k not in others}

    def as_dict(self, settings: RepliesConfig) -> dict:
        out: dict = {"rule": self.rule, "action": settings.norm_action, "why": self.why}
        if self.tensors is not None:
            out.update(tensors=sorted(self.tensors), bound=self.fixed)
        else:
            out.update(tensors="every other", norm_ratio=settings.norm_ratio, max_norm=settings.max_norm)
        return out


def relative_bound(why: str) -> ReplyBound:
    return ReplyBound("replies.norm-ratio x the round's lower median, replies.max-norm", why)


def fixed_bound(tensors: Sequence[str], clip: float) -> ReplyBound:
    return ReplyBound(
        "fixed at privacy.clip",
        "the server noises these tensors: an honest client clips its upload to C itself, so a fixed bound at C never "
        "binds for it; clipping to a fixed ball is a projection and no other client's reply enters the rule, so one "
        "record moves the pre-noise average by at most C/(N*B), the sensitivity the ledger accounts",
        frozenset(tensors),
        clip,
    )


def bound_round(
    sent: Sequence[Mapping[str, np.ndarray]],
    replies: Sequence[dict[str, np.ndarray]],
    settings: RepliesConfig,
    rules: Sequence[ReplyBound],
) -> list[tuple[dict[str, np.ndarray] | None, list[dict]]]:
    """Each reply bounded by ``rules`` (each on its part of the update; ``sent``: what each node
    was sent): the arrays to use (None: rejected) and what each rule did to it."""
    fixed_names = frozenset().union(*(r.tensors for r in rules if r.tensors is not None))
    norms = [[update_norm(s, r.part(a, fixed_names)) for s, a in zip(sent, replies, strict=True)] for r in rules]
    bounds = [
        r.fixed if r.tensors is not None else norm_bound(ns, settings.norm_ratio, settings.max_norm)
        for r, ns in zip(rules, norms, strict=True)
    ]
    out = []
    for i, (s, arrays) in enumerate(zip(sent, replies, strict=True)):
        kept: dict[str, np.ndarray] | None = dict(arrays)
        entries = []
        for rule, rule_norms, bound in zip(rules, norms, bounds, strict=True):
            norm = rule_norms[i]
            slack = FIXED_SLACK if rule.tensors is not None else 0.0
            if norm <= bound * (1 + slack):
                continue
            entries.append({"norm": norm, "bound": bound, "action": settings.norm_action, "rule": rule.rule})
            if settings.norm_action == "reject":
                kept = None
            elif kept is not None:
                part = rule.part(kept, fixed_names)
                kept.update(clipped({k: s[k] for k in part if k in s}, part, bound / norm))
        out.append((kept, entries))
    return out


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
