"""A node's part of a round, in one owner: what the node does between reading a message and
handing its reply to the send guard.

``NodeMessage.open`` reads what every message needs once (the node's own config checked, the run
config validated as the node allows it, its data); ``hello``, ``evaluate`` and ``train`` then run
the node's side of each exchange:

- ``evaluate``: the client evaluates the state the server sent; the node commits what it keeps
  (a first contact may initialise its own parts), publishes its model on the run's last
  evaluation, and persists its state;
- ``train``: the node's privacy floor checks the round before any work (``privacy_floor.guard``)
  and records the release after it (the node's own account, sent as ``node-epsilon`` where it
  states a limit); the audited node's canaries are finished; what the reply may carry is the
  method's sharing rule over the model's tensors, and what it must not, the client's private
  tensors; the node persists its state.

Every reply carries the node's time on its part (``compute-seconds``, setup included). The
node's private state is restored before a part and persisted after it through
``client_app.state``, the one module that reads and writes it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Context, RecordDict

from fedvlm.client_app import privacy_floor
from fedvlm.client_app.audit_node import finish_round, node_canaries
from fedvlm.client_app.node_config import NUM_PARTITIONS, check_node_config
from fedvlm.client_app.node_policy import for_node
from fedvlm.client_app.publishing import publish
from fedvlm.client_app.send_guard import Guarded
from fedvlm.client_app.state import persist, restore, state_dir
from fedvlm.methods.validation import validate
from fedvlm.metrics import COMPUTE_SECONDS, NODE_EPSILON
from fedvlm.protocol import (
    RUN_DIR,
    SERVER_ROUND,
    EvaluateInstruction,
    EvaluateReply,
    HelloReport,
    TrainInstruction,
)
from fedvlm.runconfig import RunConfig
from fedvlm.spec import MethodSpec, NodeClient, spec_of
from fedvlm.utils.floats import compute_report, flush_denormals

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class NodeMessage:
    """One message's node: its run config, method and data (``open``)."""

    context: Context
    cfg: RunConfig
    spec: MethodSpec
    node: Any  # the family's node data (client_app.node.NodeData, client_app.vlm_node.VLMNodeData)

    @classmethod
    def open(cls, context: Context) -> NodeMessage:
        flush_denormals()  # before the backbone loads and the compute threads start (utils.floats)
        check_node_config(context.node_config)  # the node's own settings, before anything of the run
        # a real node decides for itself what it loads and where it writes (client_app.node_policy)
        cfg = for_node(validate(context.run_config), dict(context.node_config))
        spec = spec_of(cfg)
        return cls(context, cfg, spec, spec.family.node_data(cfg, dict(context.node_config)))

    def _client(self, config: Mapping[str, Any], training: bool) -> tuple[NodeClient, Path | None]:
        """The method's client for the round ``config`` names, on the node's state as that round
        needs it (restored from its disk where memory lacks it); and where the state is kept."""
        server_round = int(config.get(SERVER_ROUND, 0))
        where = state_dir(self.node.config, str(config.get(RUN_DIR, "")), self.node.partition_id, self.node.name)
        state = self.context.state
        restore(state, where, server_round, training=training)
        canaries = node_canaries(self.cfg, self.node.partition_id, state)
        return self.spec.client(self.cfg, self.node, state, server_round, canaries), where

    def hello(self) -> HelloReport:
        """Who the node is, after checking that its own privacy limit can take the run."""
        client, _ = self._client({}, training=False)
        report = client.hello()
        records = client.records(report.num_train)  # the audited node's canary slots included
        # a run the node's own limit cannot take is refused before it starts, not at its first round
        privacy_floor.hello_check(self.node, self.context.state, self.cfg, records)
        partitions = int(self.node.config.get(NUM_PARTITIONS, 0) or 0) if report.partition_id >= 0 else 0
        return replace(report, num_train=records, num_partitions=partitions, compute=compute_report())

    def evaluate(self, config: Mapping[str, Any], arrays: dict[str, torch.Tensor]) -> EvaluateReply:
        t0 = time.time()
        client, where = self._client(config, training=False)
        instruction = EvaluateInstruction.from_config(config)
        reply = client.evaluate(arrays, instruction)
        client.commit()  # a first contact may have initialised the node's own parts
        if instruction.final_round:  # the run's last evaluation: the node publishes on its own disk
            publish(self.node, client.published(arrays), instruction)
        persist(self.context.state, where, instruction.server_round)
        return reply.with_metrics({COMPUTE_SECONDS: time.time() - t0})

    def train(self, config: Mapping[str, Any], arrays: dict[str, torch.Tensor]) -> Guarded:
        t0 = time.time()
        client, where = self._client(config, training=True)
        instruction = TrainInstruction.from_config(config)
        state = self.context.state
        release = privacy_floor.guard(self.node, state, self.cfg, instruction)
        reply = client.train(arrays, instruction)
        if release is not None:  # the node's own account of what this reply releases, checked again
            spent = privacy_floor.record(self.node, state, self.cfg, release)
            if release.limited:
                reply = reply.with_metrics({NODE_EPSILON: spent})
        if client.canaries is not None:
            reply = reply.with_metrics(finish_round(self.cfg, client.canaries, state))
        # everything this node spent on the message (setup included): the rest of a round's
        # wall time is Flower/Ray/network overhead
        reply = reply.with_metrics({COMPUTE_SECONDS: time.time() - t0})
        persist(state, where, instruction.server_round)
        # what may leave: the method's sharing rule over the tensors its model has (a LoRA
        # adapter's names are known only where the model is loaded), and what the server named
        return Guarded(reply, self.spec.shares(self.cfg, client.tensor_names), client.private, instruction.reply_keys)


def message_parts(content: RecordDict, config_key: str, arrays_key: str) -> tuple[dict[str, Any], dict]:
    """A message's instruction and tensors (``config_key``, ``arrays_key``: the records a part
    reads; a bundled evaluation reads its own)."""
    config: dict[str, Any] = dict(content[config_key]) if config_key in content else {}
    arrays: dict = {}
    if arrays_key in content:
        record = content[arrays_key]
        assert isinstance(record, ArrayRecord)  # the server sends its tensors as one
        arrays = record.to_torch_state_dict()
    return config, arrays
