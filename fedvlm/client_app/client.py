"""What every method's client is: the contract the ClientApp's handlers (``client_app.handlers``)
call, and the state each client is built with.

The contract is ``methods.spec.NodeClient`` (the registry's entries type against it). A family's
client subclasses ``Client`` and implements the three messages (``hello``, ``train``,
``evaluate``) and the ``Learner`` hooks of the one training loop (``client_app.trainer``). It is
built once per message from the run config, the node's data, the node's private state (Flower's
``Context.state``), the round, and, on the audited node only, the audit's canaries: nothing is set
on it from outside afterwards. It answers with typed replies (``protocol.TrainReply``,
``protocol.EvaluateReply``), which the send guard turns into the reply message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedvlm.client_app.state import load_private
from fedvlm.client_app.trainer import Learner
from fedvlm.methods.spec import NodeClient
from fedvlm.privacy.canaries import Canaries
from fedvlm.privacy.mechanisms import OsNoise, noise_generator, sampling_rng
from fedvlm.runconfig import RunConfig
from fedvlm.utils.rng import NodeStream, node_key


class Client(Learner, NodeClient):
    """One method's client on one node for one message (see the module docstring); the three
    messages (``hello``, ``train``, ``evaluate``) are abstract in the contract, ``NodeClient``."""

    def __init__(self, cfg: RunConfig, node: Any, state, server_round: int, canaries: Canaries | None = None):
        self.cfg = cfg
        self.node = node  # client_app.node.NodeData, or client_app.vlm_node.VLMNodeData for the VLM family
        self.state = state
        self.round = server_round
        self.canaries = canaries
        # the tensors this node keeps from round to round (its private prompt parts, its adapter,
        # optimiser state), as its private state holds them (client_app.state)
        self.own: dict[str, torch.Tensor] = load_private(state)

    @property
    def private(self) -> Mapping[str, torch.Tensor]:
        """Tensors that must never appear in a reply (the send guard compares bytes): by default
        every tensor the node keeps."""
        return self.own

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

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset()  # a prompt method's sharing rule names its tensors itself
