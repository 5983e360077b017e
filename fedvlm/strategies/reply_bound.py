"""The reply bound: a layer around the method's strategy that bounds how far each validated update
moves the model before the strategy folds it in, as Flower's fixed-clipping wrapper clips updates
before its strategy aggregates them.

``BoundedReplies`` bounds the round's updates (``bound_round``): a hostile client can send finite, well-shaped
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
  post-processing) or that no DP guarantee covers (privacy off).

The strategy inside never knows the bound: it is handed the bounded updates
(``FederatedStrategy.aggregate_updates``). Under secure aggregation the server never sees an
update; the nodes bound their own in the round's plan (``strategies.secure_aggregation``), so this
layer sits inside that one and its bound is never reached there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedvlm.protocol import TrainReply
from fedvlm.runconfig.schema import RepliesConfig
from fedvlm.strategies.layer import Layer
from fedvlm.strategies.plan import PhasePlan
from fedvlm.strategies.records import ClientUpdate

log = logging.getLogger(__name__)


class BoundedReplies(Layer):
    """Every round's validated updates bounded (``bounds``) before the strategy inside sees them."""

    def bounds(self) -> list[ReplyBound]:
        """The rules, once the run's mechanisms are planned: what the server noises at the clip."""
        return reply_bounds(self.parts.budget.noised_tensors(), self.parts.cfg.privacy.clip)

    def begin(self, grid: Grid, resumed: dict | None = None) -> None:
        self.inner.begin(grid, resumed)
        self.note_bounds()

    def note_bounds(self) -> None:
        """The rules in the run's ledger, with why each keeps its guarantee (with privacy on)."""
        if self.parts.cfg.privacy.enabled:
            self.parts.ledger.reply_bounds = [b.as_dict(self.parts.cfg.replies) for b in self.bounds()]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        kept = self.parts.phase(server_round, "train")
        return self.aggregate_updates(server_round, self.bound(self.validate(replies, kept), kept))

    def bound(self, updates: list[ClientUpdate], kept: PhasePlan) -> list[ClientUpdate]:
        """Clip or drop the updates past their bounds, recording each in ``kept``."""
        sent = [kept.outgoing[u.node.node_id].payload.arrays for u in updates]  # validated: each was sent one
        results = bound_round(sent, [u.reply.arrays for u in updates], self.parts.cfg.replies, self.bounds())
        kept_updates = []
        for u, (arrays, entries) in zip(updates, results, strict=True):
            for e in entries:
                kept.bounded.append({"client": u.node.name, **e})
                if arrays is not None:
                    log.warning(
                        "round %s: clipped the update of %s from norm %.4g to %.4g (%s)",
                        kept.round,
                        u.node.name,
                        e["norm"],
                        e["bound"],
                        e["rule"],
                    )
            if arrays is None:
                e = entries[0]
                kept.drop(
                    u.node.name,
                    f"update norm {e['norm']:.4g} exceeds the round's bound {e['bound']:.4g} ({e['rule']})",
                )
                continue
            kept_updates.append(ClientUpdate(u.node, TrainReply(arrays, u.reply.metrics)) if entries else u)
        return kept_updates


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


def reply_bounds(noised: Sequence[str], clip: float) -> list[ReplyBound]:
    """How each part of an update is bounded: the tensors the server noises (``noised``) at the
    fixed clip C, whatever ``replies.*`` says (a data-dependent bound before the server's noise
    would change the sensitivity its ledger accounts); the others by ``replies.*``."""
    fixed = [fixed_bound(noised, clip)] if noised else []
    return [
        *fixed,
        relative_bound(
            "acts only on tensors the server does not noise: each is noised by its sender (local DP), so the "
            "bound is post-processing of what the sender released, or no DP guarantee covers it"
        ),
    ]


def bound_round(
    sent: Sequence[Mapping[str, np.ndarray]],
    replies: Sequence[Mapping[str, np.ndarray]],
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
