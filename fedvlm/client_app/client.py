"""What every method's client is: the contract the ClientApp's handlers (``client_app.handlers``)
call, the state each client is built with, and the one round of training every method runs.

The contract is ``spec.NodeClient`` (the registry's entries type against it). A family's
client subclasses ``Client``. It is built once per message from the run config, the node's data,
the node's private state (Flower's ``Context.state``), the round, and, on the audited node only,
the audit's canaries: nothing is set on it from outside afterwards. It answers with typed replies
(``protocol.TrainReply``, ``protocol.EvaluateReply``), which the send guard turns into the reply
message.

``train`` is concrete here and the same for every method (see ``Client.train``). A family writes
what differs: the round's session (``begin_round``: a ``client_app.trainer.Learner`` holding what
the round trains, which lives only as long as the round), what leaves the node
(``finish_round``), and ``hello`` and ``evaluate``. ``evaluate`` only evaluates: the handler
commits the node's state and publishes its model on the final round (``published``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from fedvlm.client_app.state import load_meta, load_private, save_meta, save_private
from fedvlm.client_app.trainer import Learner, RoundStats, local_round
from fedvlm.errors import PublicError
from fedvlm.metrics import ROUNDS_TRAINED  # also the node's meta key: how many rounds it has trained
from fedvlm.privacy.canaries import Canaries
from fedvlm.privacy.mechanisms import OsNoise, noise_generator, sampling_rng
from fedvlm.privacy.planner import ClientShape, client_plan
from fedvlm.protocol import TrainInstruction, TrainReply
from fedvlm.runconfig import RunConfig
from fedvlm.runconfig.schema import PrivacyConfig
from fedvlm.spec import NodeClient, spec_of
from fedvlm.utils.rng import NodeStream, node_key


class RequestRefused(PublicError, RuntimeError):
    """The node will not do what the server's message asks; the text names the request and the
    rule it breaks (what the server sent, the node's sizes the handshake released), never a value
    of the node's records."""


class Client(NodeClient):
    """One method's client on one node for one message (see the module docstring)."""

    def __init__(self, cfg: RunConfig, node: Any, state, server_round: int, canaries: Canaries | None = None):
        self.cfg = cfg
        self.node = node  # client_app.node.NodeData, or client_app.vlm_node.VLMNodeData for the VLM family
        self.state = state
        self.round = server_round
        self.canaries = canaries
        # the tensors this node keeps from round to round (its private prompt parts, its adapter,
        # optimiser state), as its private state holds them (client_app.state)
        self.own: dict[str, torch.Tensor] = load_private(state)
        self.meta = load_meta(state)  # the node's small bookkeeping (rounds trained, what it sent)

    # --- the one round ---------------------------------------------------------------------------
    def train(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction) -> TrainReply:
        """One round of local training, the same for every method: the request checked against
        the method's rule (``check_request``), the server's plan accepted only if it carries the
        noise this node's own plan needs (``client_plan``), the round's session
        (``begin_round``), the one loop (``local_round``) with this node's streams, what leaves
        the node (``finish_round``), and the node's state committed."""
        n = self.training_records()
        self.check_request(arrays, instruction)
        shape, sigma = client_plan(self.cfg, spec_of(self.cfg).local_dp, self.records(n), instruction)
        session = self.begin_round(arrays, instruction)
        with self.loop_context():
            stats = local_round(session, shape, self.step_privacy(), sigma, self.rng(), self.noise(), self.canaries)
        self.meta[ROUNDS_TRAINED] = int(self.meta.get(ROUNDS_TRAINED, 0)) + 1
        reply = self.finish_round(session, stats, shape, sigma, instruction)
        self.commit()
        return reply

    @abstractmethod
    def training_records(self) -> int:
        """How many training records this node holds (its own, without canary slots); raises
        where it holds none, as there is nothing to train on."""

    def check_request(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction) -> None:
        """Refuse a train message that breaks the method's rule on what is exchanged (default:
        the send guard's checks on the reply are enough)."""

    @abstractmethod
    def begin_round(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction) -> Learner:
        """This round's session: the leaves, optimiser and data the loop's hooks work on, built
        from what the server sent and what the node keeps."""

    def loop_context(self) -> AbstractContextManager:
        """What the loop runs inside (default: nothing; e.g. LoRA seeds torch's global generator)."""
        return nullcontext()

    def step_privacy(self) -> PrivacyConfig:
        """The privacy of each local step (default: the run's)."""
        return self.cfg.privacy

    @abstractmethod
    def finish_round(
        self, session: Learner, stats: RoundStats, shape: ClientShape, sigma: float, instruction: TrainInstruction
    ) -> TrainReply:
        """What the round leaves behind: the node's own tensors for its next round (into ``own``
        and ``meta``) and the reply (the tensors that leave it, the round's metrics)."""

    def commit(self) -> None:
        """Write what the node keeps into its private state (the handler then persists it)."""
        save_private(self.state, self.own)
        save_meta(self.state, self.meta)

    # --- what the node is ------------------------------------------------------------------------
    def records(self, n_real: int) -> int:
        """The training records this node reports and plans with: its own, plus the audit's
        canary slots (all m of them, present or not, so the count reveals nothing)."""
        return n_real + (self.canaries.m if self.canaries is not None else 0)

    @property
    def private(self) -> Mapping[str, torch.Tensor]:
        """Tensors that must never appear in a reply (the send guard compares bytes): by default
        every tensor the node keeps."""
        return self.own

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset()  # a prompt method's sharing rule names its tensors itself

    def published(self, arrays: dict[str, torch.Tensor]) -> dict | None:
        """What the node publishes on its own disk at the end of a run (``client_app.publishing``),
        for the state the server sent; None: nothing (the default)."""
        return None

    # --- this round's random streams -------------------------------------------------------------
    def rng(self) -> np.random.Generator:
        """This round's batch sampling: from the node's noise source (the OS on a real node, so the
        batches are as secret as the noise), keyed by the run's seed, the node and the round."""
        return sampling_rng(
            self.node.noise_source, node_key(self.cfg.seed, self.node.seed, NodeStream.BATCHES, self.round)
        )

    def noise(self) -> torch.Generator | OsNoise:
        """This round's local-DP noise, from the same source and key."""
        return noise_generator(
            self.node.noise_source, node_key(self.cfg.seed, self.node.seed, NodeStream.LOCAL_NOISE, self.round)
        )
