"""What a strategy's hooks write while a round runs, and what a strategy leaves at the end of a
run; the server loop (``server_app.loop``) turns both into the run folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fedvlm.strategies.nodes import NodeInfo


@dataclass
class ClientUpdate:
    node: NodeInfo
    arrays: dict[str, np.ndarray]
    metrics: dict


@dataclass
class RoundRecord:
    """One round, as results.json records it (``server_app.results``)."""

    round: int
    final: bool = False  # the last evaluation of the run: clients publish what they reached
    sampled: int = 0  # clients sent a train message
    metrics: dict[str, float] = field(default_factory=dict)
    clients: dict[str, dict] = field(default_factory=dict)  # per-client figures, by name
    dropped: list[dict] = field(default_factory=list)  # rejected replies and why
    bounded: list[dict] = field(default_factory=list)  # updates past the norm bound: norm, bound, action
    asked_again: list[dict] = field(default_factory=list)  # late replies asked again (server_app.exchange)
    missing: list[dict] = field(default_factory=list)  # sampled clients whose reply never came
    bytes: dict[str, int] = field(default_factory=dict)  # train_down, train_up, evaluate_down, evaluate_up

    def client(self, name: str) -> dict:
        return self.clients.setdefault(name, {})

    def add_bytes(self, key: str, n: int) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + n

    def as_dict(self, seconds: float) -> dict:
        return {
            "round": self.round,
            "sampled": self.sampled,
            "metrics": self.metrics,
            "seconds": round(seconds, 3),
            "bytes_up": sum(v for k, v in self.bytes.items() if k.endswith("_up")),
            "bytes_down": sum(v for k, v in self.bytes.items() if k.endswith("_down")),
            "bytes": self.bytes,
            "clients": self.clients,
            "dropped": self.dropped,
            "bounded": self.bounded,
            "asked_again": self.asked_again,
            "missing": self.missing,
        }


@dataclass
class RunOutputs:
    """What a strategy adds to the run folder after the last round."""

    arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # file name -> tensors
    sections: dict[str, dict] = field(default_factory=dict)  # results.json section -> content
