"""The one-run privacy audit's bound (Steinke, Nasr and Jagielski, "Privacy auditing with one (1)
training run", NeurIPS 2023): from an auditor's guesses about m canaries, each inserted into the
training data independently with probability 1/2, a lower bound on the epsilon of the mechanism
that trained on them.

The auditor guesses "in" or "out" for r of the canaries (abstaining on the rest) and v of its
guesses are right. An (epsilon, delta)-DP mechanism cannot let a guesser do much better than
randomised response with accuracy q = e^eps / (1 + e^eps):

    P[v or more right] <= f(v) + 2 m delta max_{1<=i<=v} (f(v - i) - f(v)) / i,
    f(u) = P[Binomial(r, q) >= u]

(with delta = 0 this is the plain Binomial tail). The audit's epsilon is the largest epsilon
whose bound on the observed v is below 1 - confidence: every smaller epsilon is rejected at
that confidence. It is a LOWER bound on the true epsilon: it can only fall short of the
accountant's number (weak canaries, few guesses), and a value above it means the mechanism or
its accounting is broken. The derivation and its sources: docs/research/privacy-audit-maths.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy.stats import binom

from fedvlm.errors import PublicError
from fedvlm.metrics import AUDIT_FIGURES

if TYPE_CHECKING:
    from fedvlm.privacy.planner import LocalDP
    from fedvlm.runconfig.schema import PrivacyConfig


class CanaryError(PublicError, ValueError):
    """An audit the audited node cannot run as configured; the message names the fix. Its text is
    built from the run config and the model's tensor names and sizes, never from a record, so it
    reaches the server (``fedvlm.errors``), which ends the run on it (``refused``)."""


class AuditRefused(RuntimeError):
    """The run asked for an audit (``privacy.audit-canaries``) that its audited node refuses."""


class AuditInputError(ValueError):
    """Counts that no audit can produce; the message names the one that is wrong."""


def _check(m: int, r: int, v: int, delta: float) -> None:
    if not (0 <= v <= r <= m):
        raise AuditInputError(
            f"audit counts must satisfy 0 <= correct <= guesses <= canaries, got correct={v}, guesses={r}, canaries={m}"
        )
    if not 0 <= delta < 1:
        raise AuditInputError(f"audit delta must be in [0, 1), got {delta}")


def guess_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on the probability that r guesses about m canaries get v or more right when
    the mechanism is (epsilon, delta)-DP (the p-value of observing v under that hypothesis)."""
    _check(m, r, v, delta)
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]; sf, not 1 - cdf, for q near 1
    if delta == 0 or v == 0:
        return tail
    i = np.arange(1, v + 1)
    # f(v - i) - f(v) = P[v - i <= Binomial < v]: the mass that delta may move above the threshold
    alpha = float(np.max((binom.sf(v - i - 1, r, q) - tail) / i))
    return min(tail + 2 * m * delta * max(alpha, 0.0), 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon that r guesses with v right (out of m canaries) reject at
    ``confidence``: the mechanism is not (eps, delta)-DP for any smaller eps. 0 when the guesses
    are no better than chance allows."""
    _check(m, r, v, delta)
    if not 0 < confidence < 1:
        raise AuditInputError(f"audit confidence must be in (0, 1), got {confidence}")
    significance = 1 - confidence
    if guess_p_value(m, r, v, 0.0, delta) >= significance:
        return 0.0
    lo, hi = 0.0, 1.0  # p-value(lo) < significance <= p-value(hi); the p-value grows with epsilon
    while guess_p_value(m, r, v, hi, delta) < significance:
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # every guess right with r huge and delta 0: no finite epsilon explains it
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        if guess_p_value(m, r, v, mid, delta) < significance:
            lo = mid
        else:
            hi = mid
    return lo


# The auditor's guesses, fixed before looking at which canaries are in: for each fraction f of
# the m canaries, r = round(f m) guesses, "in" for the ceil(r/2) highest scores and "out" for
# the floor(r/2) lowest. Every fraction is tested at confidence 1 - (1 - c) / len(GUESS_FRACTIONS)
# (Bonferroni), so reporting the best of them keeps the stated confidence c.
GUESS_FRACTIONS = (0.1, 0.25, 0.5, 1.0)
GUESS_RULE = (
    f"r = round(f m) for f in {list(GUESS_FRACTIONS)}; 'in' for the ceil(r/2) highest scores, 'out' for the "
    "floor(r/2) lowest; the best r reported, each tested at Bonferroni-corrected confidence"
)


@dataclass(frozen=True)
class AuditResult:
    canaries: int  # m
    guesses: int  # r of the best guess rule
    correct: int  # v of the best guess rule
    guessed_in: int  # of them, "in" guesses (the highest scores)
    epsilon_lower: float  # the bound at the stated confidence, Bonferroni over GUESS_FRACTIONS
    confidence: float
    delta: float

    def as_dict(self) -> dict:
        return {
            "canaries": self.canaries,
            "guesses": self.guesses,
            "correct": self.correct,
            "guessed_in": self.guessed_in,
            "epsilon_lower": self.epsilon_lower,
            "confidence": self.confidence,
            "delta": self.delta,
            "guess_rule": GUESS_RULE,
        }


def audit_guesses(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float = 0.95) -> AuditResult:
    """The audit from the canaries' scores (higher: more likely in) and the truth (which were in)."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    m = len(scores)
    if m == 0 or len(included) != m:
        raise AuditInputError(f"an audit needs one score per canary, got {m} scores for {len(included)} canaries")
    order = np.argsort(-scores, kind="stable")  # highest first
    each = 1 - (1 - confidence) / len(GUESS_FRACTIONS)
    best = AuditResult(m, 0, 0, 0, 0.0, confidence, delta)
    for fraction in GUESS_FRACTIONS:
        r = max(1, round(fraction * m))
        k_in = math.ceil(r / 2)
        guessed_in, guessed_out = order[:k_in], order[m - (r - k_in) :]
        v = int(included[guessed_in].sum() + (~included[guessed_out]).sum())
        eps = epsilon_lower_bound(m, r, v, delta, each)
        if eps > best.epsilon_lower or best.guesses == 0:
            best = AuditResult(m, r, v, k_in, eps, confidence, delta)
    return best


# ---- the run's audit section (results.json 'audit', written by server_app.loop) -------------
AUDIT_PREFIX = "train/audit-"


def _node_audit(name: str, rnd: int, found: dict, spent: dict, mechanism: LocalDP, end: tuple[int, bool]) -> dict:
    """Node ``name``'s audit of round ``rnd`` (its figures ``found``) beside the epsilon ``spent``
    accounts for it; ``end``: the run's last round, and whether the rounds reached it."""
    last_round, ended = end
    lower = float(found["epsilon-lower"])
    composed = spent.get("spent", {}).get(name)
    alone = spent.get("spent_components", {}).get(mechanism.name, {}).get(name)
    claimed = alone if alone is not None else composed
    if not ended:
        status = (
            f"interim (round {rnd} of {last_round}): a lower bound of {lower:.4g}; the audit's test is the last "
            "round's, a bound read at every round crosses the accounted epsilon by chance"
        )
    elif claimed is not None and lower > claimed * (1 + 1e-9):
        status = (
            f"BROKEN: the audit proves epsilon >= {lower:.4g}, above the {claimed:.4g} accounted for the audited "
            "mechanism: the mechanism or its accounting is wrong"
        )
    else:
        status = "consistent: the audited lower bound does not exceed the accounted epsilon"
    return {
        "round": rnd,
        "canaries": int(found["canaries"]),
        "guesses": int(found["guesses"]),
        "correct": int(found["correct"]),
        "guessed_in": int(found["guessed-in"]),
        "private_steps": int(found["steps"]),
        "epsilon_lower": lower,
        "accounted_epsilon": composed,
        "accounted_epsilon_audited_mechanism": alone,
        "status": status,
    }


def refused(record: dict, node: str | None, settings: PrivacyConfig) -> None:
    """Raise ``AuditRefused`` where round ``record``'s audited ``node`` (None: it is not among the
    run's nodes) refused its canaries (``CanaryError``). The run then ends: its settings make the
    refusal repeat every round, and a run that trained on without the audit it was asked for would
    publish an epsilon no audit checked, after spending every round's compute and privacy. Who the
    audited node is rests on the node identities the SuperLink vouches for: without SuperNode
    authentication, a node that takes a disconnected audited node's name (``NodeRegistry``'s
    rejoin) can end the run this way, as it could leave the audit missing."""
    for dropped in record.get("dropped", ()):
        if node is not None and dropped.get("client") == node and f"{CanaryError.__name__}: " in dropped["reason"]:
            raise AuditRefused(
                f"the one-run audit (privacy.audit-canaries = {settings.audit_canaries}) cannot run on its node "
                f"{node} (privacy.audit-node = {settings.audit_node}), which refused it in round {record['round']}: "
                f"{dropped['reason']}; the run stops rather than train without the audit it asked for"
            )


def missing_section(rounds: list[dict], node: str | None, settings: PrivacyConfig, last_round: int) -> dict | None:
    """The audit section of a run that reached ``last_round`` with no audit reported (None before
    then): its status names the audit asked for and why none came, and ``fedvlm.status`` fails it."""
    if not rounds or max(r["round"] for r in rounds) < last_round:
        return None
    who = (
        f"no node of partition id {settings.audit_node} is among the run's nodes (privacy.audit-node): it never "
        "joined, or its handshake was refused (run.excluded_nodes)"
        if node is None
        else f"node {node} was never sampled for training, or none of its train replies carried an accepted audit "
        "(rounds' dropped)"
    )
    return {"status": f"MISSING: privacy.audit-canaries = {settings.audit_canaries} asked for an audit, but {who}"}


def audit_section(
    rounds: list[dict], spent: dict, mechanism: LocalDP, global_mechanism: str | None, end: tuple[int, str | None]
) -> dict | None:
    """The audited node's latest audit (from its train replies in ``rounds``) beside what the
    ledger says its records spent (``spent``: ``privacy.budget.RunBudget.current``, after the last round).
    ``mechanism``: the method's ``LocalDP``, the mechanism the canaries enter. ``end``: the run's last
    round and the audited node's name. None without an audit.

    Only the audited node's figures are read, and only a whole set of them: another node's made-up
    figures (a bound of 1e9, a partial set) would otherwise fail a sound run, or stand in for an
    audit that never came.

    The audit is one test, of the run's last round (``last_round``): its 95% holds for one look.
    Read at every round, a bound that wanders above the accounted epsilon by chance would be seen
    at some round far more often than 5% of the time (a 100-round DP-FPL run at epsilon 0.1 crossed
    at rounds 26 to 60, and ended consistent), so before the last round the status is interim and
    no verdict."""
    last_round, audited = end
    latest: tuple[int, dict] | None = None
    for record in rounds:
        figures = record.get("clients", {}).get(audited) or {}
        found = {k[len(AUDIT_PREFIX) :]: v for k, v in figures.items() if k.startswith(AUDIT_PREFIX)}
        if set(AUDIT_FIGURES) <= found.keys():
            latest = (record["round"], found)
    if audited is None or latest is None:
        return None
    ended = max(r["round"] for r in rounds) >= last_round  # the node's latest audit is then its last
    nodes = {audited: _node_audit(audited, *latest, spent, mechanism, (last_round, ended))}
    reach = (
        f"the canaries' gradient on the tensors the server noises ({global_mechanism}) is zero: the audit bounds the "
        "node's local mechanism alone, whose accounted epsilon is accounted_epsilon_audited_mechanism"
        if global_mechanism
        else "the canaries enter every tensor the node's mechanism noises"
    )
    return {
        "mechanism": mechanism.name,
        "where": mechanism.where,
        "canary": "white-box Dirac gradient canaries (privacy.canaries): per-sample gradient C at one coordinate of "
        "every locally noised clip group, each present with probability 1/2 from OS entropy; score = sum over the "
        "node's private steps of the released noised gradient at its coordinates",
        "reach": reach,
        "guess_rule": GUESS_RULE,
        "nodes": nodes,
    }
