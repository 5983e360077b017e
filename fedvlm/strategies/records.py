"""What a round and a run leave behind: a validated reply (``ClientUpdate``), the sum a layer
gives in its place (``RoundSum``), a round's record
(built by the loop from the round's plan, ``strategies.plan``) and what a strategy adds to the
run folder at the end (``RunOutputs``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fedvlm.protocol import EvaluateReply, TrainReply

if TYPE_CHECKING:
    from fedvlm.strategies.nodes import NodeInfo
    from fedvlm.strategies.plan import RoundPlan

# a client's metrics in its round row (``RoundRecord.clients``), by the message that carried them
TRAIN_ROW, EVAL_ROW = "train/", "eval/"

# What a round's bytes were for, each way: training (its secure-aggregation stages included) and
# evaluation. These four names are results.json's, rounds.csv's and the trackers' (one spelling).
TRAFFIC = {"train": ("train", "secure"), "evaluate": ("evaluate",)}
TRAFFIC_KEYS = tuple(f"{purpose}_bytes_{way}" for purpose in TRAFFIC for way in ("up", "down"))


def traffic(parts: dict[str, int]) -> dict[str, int]:
    """A round's bytes by phase ({"train_down": .., "secure_up": .., ...}) as its traffic by
    purpose and direction (``TRAFFIC_KEYS``)."""
    return {
        f"{purpose}_bytes_{way}": sum(parts.get(f"{phase}_{way}", 0) for phase in phases)
        for purpose, phases in TRAFFIC.items()
        for way in ("up", "down")
    }


@dataclass(frozen=True)
class ClientUpdate:
    """A reply the server checked and took: whose it is, and what it says (its tensors decoded)."""

    node: NodeInfo
    reply: TrainReply | EvaluateReply


@dataclass(frozen=True)
class RoundSum:
    """What a layer around the strategy (``strategies.secure_aggregation``) gives it in place of a
    round's updates: the sum over the round's ``survivors`` (node ids) of each tensor's weighted
    update (returned minus sent), flat, and of its weights."""

    sums: dict[str, np.ndarray]
    weights: dict[str, float]
    survivors: list[int]


@dataclass
class RoundRecord:
    """One round, as results.json records it (``server_app.results``): built by the loop from
    the round's plan and the metrics the aggregation returned (``of``)."""

    round: int
    sampled: int = 0  # clients sent a train message
    metrics: dict[str, float] = field(default_factory=dict)
    clients: dict[str, dict] = field(default_factory=dict)  # per-client figures, by name
    dropped: list[dict] = field(default_factory=list)  # rejected replies and why
    refused_metrics: list[dict] = field(default_factory=list)  # metrics left out of kept replies, and why
    bounded: list[dict] = field(default_factory=list)  # updates past the norm bound: norm, bound, action
    asked_again: list[dict] = field(default_factory=list)  # late replies asked again (server_app.exchange)
    missing: list[dict] = field(default_factory=list)  # sampled clients whose reply never came
    bytes: dict[str, int] = field(default_factory=dict)  # train_down, train_up, evaluate_down, evaluate_up
    secure_aggregation: dict | None = None  # the protocol's account of a secure round (strategies.secure_sum)

    @classmethod
    def of(cls, plan: RoundPlan, metrics: dict[str, float]) -> RoundRecord:
        record = cls(plan.round, plan.sampled, dict(metrics))
        for phase in (plan.train, plan.evaluate):
            if phase is None:
                continue
            for name, row in phase.clients.items():
                record.clients.setdefault(name, {}).update(row)
            record.dropped += phase.dropped
            record.refused_metrics += phase.refused_metrics
            record.bounded += phase.bounded
            record.asked_again += phase.asked_again
            record.missing += phase.missing
            record.bytes[f"{phase.phase}_down"] = phase.bytes_down
            if phase.bytes_up is not None:
                record.bytes[f"{phase.phase}_up"] = phase.bytes_up
            if phase.secure is not None:
                record.secure_aggregation = phase.secure
                record.bytes["secure_down"] = phase.secure.get("bytes_down", 0)
                record.bytes["secure_up"] = phase.secure.get("bytes_up", 0)
        return record

    def as_dict(self, seconds: float, evaluated: bool | None = True) -> dict:
        """The record results.json keeps; ``evaluated`` False: written before the round's
        evaluation came back (it travels with the next round's train messages), completed by
        ``with_evaluation``; None: the round is not evaluated (``evaluate-every``), its record is
        complete as it is (``complete``)."""
        return {
            "round": self.round,
            "sampled": self.sampled,
            "evaluated": evaluated,
            "metrics": self.metrics,
            "seconds": round(seconds, 3),
            **traffic(self.bytes),
            "bytes": self.bytes,
            "clients": self.clients,
            "dropped": self.dropped,
            "refused_metrics": self.refused_metrics,
            "bounded": self.bounded,
            "asked_again": self.asked_again,
            "missing": self.missing,
            **({"secure_aggregation": self.secure_aggregation} if self.secure_aggregation is not None else {}),
        }


def complete(record: dict) -> bool:
    """Whether a round's record is final: its evaluation came back, or the round is not evaluated
    (``evaluated`` None, ``evaluate-every``); False while its evaluation is still to come."""
    return record.get("evaluated") is not False


def with_evaluation(record: dict, evaluation: RoundRecord, seconds: float | None = None) -> dict:
    """``record`` (a round's, written before its evaluation came back) completed with
    ``evaluation`` (the record of that round's evaluation phase alone); ``seconds``: the round's
    time, where known now (not after a resume)."""
    done = evaluation.as_dict(seconds if seconds is not None else record["seconds"])
    out = {
        **record,
        "evaluated": True,
        "seconds": done["seconds"],
        "metrics": {**record["metrics"], **evaluation.metrics},
    }
    out["clients"] = {name: dict(row) for name, row in record["clients"].items()}
    for name, row in evaluation.clients.items():
        out["clients"].setdefault(name, {}).update(row)
    for key in ("dropped", "refused_metrics", "bounded", "asked_again", "missing"):
        out[key] = record.get(key, []) + done[key]
    out["bytes"] = {**record["bytes"], **evaluation.bytes}
    return {**out, **traffic(out["bytes"])}


@dataclass
class RunOutputs:
    """What a strategy adds to the run folder after the last round."""

    arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # file name -> tensors
    sections: dict[str, dict] = field(default_factory=dict)  # results.json section -> content
